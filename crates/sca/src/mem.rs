//! A lower file in memory, for tests and tools that exercise [`crate::ScaFile`] without a file
//! system. Its bytes are shared, so a test can look at (or damage) them between operations.

use std::sync::Arc;

use parking_lot::Mutex;
use plyfs_stack::Result;

use crate::file::LowerIo;

#[derive(Clone, Default)]
pub struct MemLower(pub Arc<Mutex<Vec<u8>>>);

impl LowerIo for MemLower {
    fn read_at(&self, off: u64, len: usize) -> Result<Vec<u8>> {
        let b = self.0.lock();
        let start = (off as usize).min(b.len());
        Ok(b[start..(start + len).min(b.len())].to_vec())
    }

    fn write_at(&self, off: u64, data: &[u8]) -> Result<()> {
        let mut b = self.0.lock();
        let end = off as usize + data.len();
        if b.len() < end {
            b.resize(end, 0);
        }
        b[off as usize..end].copy_from_slice(data);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<()> {
        self.0.lock().resize(len as usize, 0);
        Ok(())
    }

    fn len(&self) -> Result<u64> {
        Ok(self.0.lock().len() as u64)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn writable(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        "mem".into()
    }
}
