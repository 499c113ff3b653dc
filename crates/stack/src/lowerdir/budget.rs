//! The budget of node descriptors that every bottom layer of the process shares, and the pass
//! that closes idle ones when it runs out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{LowerDir, NodeTable};
use super::sys::open_files_limit;

/// The node descriptors of every bottom layer of this process share one budget: a tree has a
/// bottom layer per branch, and together they must stay within the process's open-files limit.
/// When the count passes the budget, idle descriptors are closed in whichever bottom layer
/// holds them.
pub(super) struct FdBudget {
    pub(super) open: AtomicU64,
    budget: std::sync::OnceLock<u64>,
    pub(super) tables: Mutex<Vec<std::sync::Weak<Mutex<NodeTable>>>>,
}

pub(super) fn fd_budget() -> &'static FdBudget {
    static BUDGET: std::sync::OnceLock<FdBudget> = std::sync::OnceLock::new();
    BUDGET.get_or_init(|| FdBudget { open: AtomicU64::new(0), budget: std::sync::OnceLock::new(), tables: Mutex::new(Vec::new()) })
}

impl FdBudget {
    /// Half the open-files limit as it is when first needed (the daemon raises it first).
    pub(super) fn budget(&self) -> u64 {
        *self.budget.get_or_init(|| (open_files_limit().rlim_cur / 2).max(64))
    }
}

/// Close the descriptors of nodes not used since the last pass (second chance), in every
/// bottom layer of the process, until a quarter of the budget is free. Only nodes that can be
/// reopened by handle are closed. One table is locked at a time.
pub(super) fn close_idle_node_fds() {
    let budget = fd_budget();
    let target = budget.budget() * 3 / 4;
    let tables: Vec<Arc<Mutex<NodeTable>>> = {
        let mut tables = budget.tables.lock();
        tables.retain(|t| t.strong_count() > 0);
        tables.iter().filter_map(std::sync::Weak::upgrade).collect()
    };
    for table in tables {
        let table = table.lock();
        for (node, _) in table.by_id.values() {
            if budget.open.load(Ordering::Relaxed) <= target {
                return;
            }
            if node.handle.is_none() || node.pinned.load(Ordering::Relaxed) || node.used.swap(false, Ordering::Relaxed) {
                continue;
            }
            if let Some(mut slot) = node.fd.try_lock() {
                if slot.as_ref().is_some_and(|fd| Arc::strong_count(fd) == 1) {
                    *slot = None;
                    budget.open.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Drop for LowerDir {
    fn drop(&mut self) {
        // Its descriptors close with it: they no longer count against the budget.
        let open = self.nodes.lock().by_id.values().filter(|(n, _)| n.fd.lock().is_some()).count() as u64;
        fd_budget().open.fetch_sub(open.min(fd_budget().open.load(Ordering::Relaxed)), Ordering::Relaxed);
    }
}
