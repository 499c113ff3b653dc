//! Branches at run time: `branch-list`, `branch-add` and `branch-remove`, and how a branch is
//! found when it joins (marked or not).

use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use plyfs_stack::spec::{BranchMode, BranchSpec};
use plyfs_stack::{Branch, Error, NodeId, Op, Result};
use serde_json::{json, Value};

use super::{daemon, BranchState, Union, MARK_XATTR};
use crate::ids::{Place, MAX_BRANCH_NUMBERS};

impl Union {
    pub(super) fn branch_list(&self) -> Value {
        let list: Vec<Value> = self
            .snapshot()
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let mut row = json!({
                    "position": i,
                    "name": b.branch.name,
                    "mode": b.branch.mode.as_str(),
                    "open_files": b.opens.load(Ordering::Relaxed),
                });
                let (place, at) = b.branch.lower.field();
                row[place] = at.into();
                row
            })
            .collect();
        Value::Array(list)
    }

    pub(super) fn branch_add(&self, args: &[String]) -> Result<Value> {
        let usage = || Error::BadArgs("usage: branch-add PATH [ro|rw] [POSITION]".into());
        let path = args.first().ok_or_else(usage)?;
        let mut mode = BranchMode::ReadWrite;
        let mut position = None;
        for a in &args[1..] {
            match (BranchMode::parse(a), a.parse::<usize>()) {
                (Some(m), _) => mode = m,
                (None, Ok(p)) => position = Some(p),
                _ => return Err(Error::BadArgs(format!("branch-add: '{a}' is neither ro, rw nor a position"))),
            }
        }
        let number = self.next_number.fetch_add(1, Ordering::Relaxed);
        if number > MAX_BRANCH_NUMBERS {
            return Err(Error::BadArgs(format!("branch-add: this mount has had {MAX_BRANCH_NUMBERS} branches; remount to add more")));
        }
        let name = format!("{}.{number}", self.name);
        let spec = BranchSpec { name: Some(name.clone()), dir: Some(path.into()), mode: Some(mode), layers: Vec::new() };
        let branch = self.builder.build(&name, &spec).map_err(|e| Error::BadArgs(e.to_string()))?;
        let current: Vec<Branch> = self.snapshot().iter().map(|b| b.branch.clone()).collect();
        plyfs_stack::check_branch_lowers(&current, &branch).map_err(|e| Error::BadArgs(e.to_string()))?;
        let state = Arc::new(BranchState::found(branch, number));
        {
            let mut branches = self.branches.write();
            let at = position.unwrap_or(branches.len()).min(branches.len());
            branches.insert(at, state);
        }
        self.refresh_root_places();
        tracing::info!("union '{}': branch '{name}' ({path}, {}) added", self.name, mode.as_str());
        Ok(self.branch_list())
    }

    pub(super) fn branch_remove(&self, args: &[String]) -> Result<Value> {
        let [name] = args else {
            return Err(Error::BadArgs("usage: branch-remove NAME".into()));
        };
        // The kernel sends a file's release after its last close has returned: a removal right
        // after closing the last file waits a moment for releases in flight.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while std::time::Instant::now() < deadline {
            let busy = self
                .branches
                .read()
                .iter()
                .any(|b| b.branch.is_called(name) && b.opens.load(Ordering::Relaxed) > 0);
            if !busy {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let removed = {
            let mut branches = self.branches.write();
            let at = branches
                .iter()
                .position(|b| b.branch.is_called(name))
                .ok_or_else(|| Error::BadArgs(format!("branch-remove: no branch named '{name}'")))?;
            if branches.len() == 1 {
                return Err(Error::BadArgs(format!("branch-remove: '{name}' is the last branch")));
            }
            let opens = branches[at].opens.load(Ordering::Relaxed);
            if opens > 0 {
                return Err(Error::BadArgs(format!("branch-remove: {opens} files are open on branch '{name}'")));
            }
            branches.remove(at)
        };
        // Objects known only there go stale; merged directories lose that place.
        let dropped: Vec<Place> = {
            let mut table = self.nodes.lock();
            let mut dropped = Vec::new();
            for n in table.nodes.values_mut() {
                n.places.retain(|p| {
                    let keep = p.branch != removed.number;
                    if !keep {
                        dropped.push(*p);
                    }
                    keep
                });
            }
            dropped
        };
        for p in dropped.iter().filter(|p| p.node != NodeId::ROOT) {
            removed.top().forget(&daemon(), p.node, 1);
        }
        self.refresh_root_places();
        removed.branch.stack.shutdown();
        tracing::info!("union '{}': branch '{name}' removed", self.name);
        Ok(self.branch_list())
    }

    fn refresh_root_places(&self) {
        let places = self.snapshot().iter().map(|b| Place { branch: b.number, node: NodeId::ROOT }).collect();
        if let Some(root) = self.nodes.lock().nodes.get_mut(&NodeId::ROOT.0) {
            root.places = places;
        }
    }
}

impl BranchState {
    /// A branch as found: marked if the union wrote there before.
    pub(super) fn found(branch: Branch, number: u32) -> BranchState {
        let op = Op::GetXattr { node: NodeId::ROOT, name: OsStr::new(MARK_XATTR), size: 16 };
        let marked = branch.top().call(&daemon(), &op).is_ok();
        BranchState { branch, number, marked: AtomicBool::new(marked), opens: AtomicU64::new(0) }
    }
}
