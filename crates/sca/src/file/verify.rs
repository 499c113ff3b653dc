//! `verify`: every chunk decoded and the index checked, rebuilt once if it disagrees with the
//! records.

use plyfs_stack::shared::LockKind;
use plyfs_stack::Result;
use serde_json::{json, Value};

use crate::chunks::chunk_start;

use super::{Fault, LowerIo, ScaFile};

impl<L: LowerIo> ScaFile<L> {
    /// Decode every chunk and check the index: a report of what is wrong, if anything.
    ///
    /// An index that disagrees with the records (a daemon killed in the middle of a compaction
    /// leaves the slot naming the checkpoint from before it) is rebuilt from the data, as any
    /// read would, and the check starts again; only what is wrong after that is a problem.
    pub fn verify(&mut self) -> Result<Value> {
        self.locked(LockKind::Exclusive, |f| f.verify_now())
    }

    fn verify_now(&mut self) -> Result<Value> {
        let mut rebuilt = None;
        let rebuilt_at_load = self.rebuilt_at_load.take();
        loop {
            let len = self.lower.len()?;
            let mut problems = Vec::new();
            // Lost chunks have no records, which the index check would call inconsistent: the
            // reads below report them instead.
            let mut stale = if self.lost.is_empty() { self.ix.validate(len).err().map(|e| e.to_string()) } else { None };
            let cs = self.ix.chunk_bytes();
            let mut chunk = 0;
            while stale.is_none() && chunk < self.ix.chunks() {
                match self.read_stored(chunk_start(self.ix.chunk_shift, chunk), cs as usize) {
                    Ok(_) => {}
                    Err(Fault::Stale(why)) => stale = Some(why),
                    Err(Fault::Fail(e)) => problems.push(json!({ "offset": chunk_start(self.ix.chunk_shift, chunk), "error": e.to_string() })),
                }
                chunk += 1;
            }
            match stale {
                Some(why) if rebuilt.is_none() => {
                    tracing::warn!("{}: the index is inconsistent ({why}); rebuilding it from the data", self.lower.describe());
                    self.flush_pending()?;
                    let known = self.ix.clone();
                    self.rebuild(self.ix.chunk_shift, Some(&known))?;
                    rebuilt = Some(why);
                    continue;
                }
                Some(why) => problems.push(json!({ "offset": Value::Null, "error": format!("index: {why}") })),
                None => {}
            }
            return Ok(json!({
                "ok": problems.is_empty(),
                "chunks": self.ix.chunks(),
                "size": self.ix.size,
                "index_rebuilt": rebuilt.or(rebuilt_at_load),
                "problems": problems,
            }));
        }
    }
}
