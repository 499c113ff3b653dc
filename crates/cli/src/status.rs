//! `plyfs status` (`plyfs list`): the plyfs mounts of this user (every user's, for root), each
//! as its daemon describes itself over the control socket, or as a stale mount when no daemon
//! answers.

use std::time::Duration;

use plyfs_fuse::{control, mountinfo};
use serde_json::{json, Value};

/// The columns, in the order shown.
const COLUMNS: [&str; 7] = ["mountpoint", "lower", "stack", "pid", "transport", "log", "state"];

/// How long a daemon has to answer before it is reported as not answering.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

pub fn status(as_json: bool) -> Result<(), String> {
    let me = unsafe { libc::geteuid() };
    let rows: Vec<Value> = mountinfo::mounts()
        .into_iter()
        .filter(|m| m.is_plyfs() && (me == 0 || m.user_id == Some(me)))
        .map(|m| describe(&m))
        .collect();
    if as_json {
        println!("{}", serde_json::to_string_pretty(&Value::Array(rows)).unwrap_or_default());
    } else if rows.is_empty() {
        eprintln!("plyfs: no plyfs mounts{}", if me == 0 { "" } else { " of yours" });
    } else {
        print!("{}", crate::table::draw_columns(&rows, &COLUMNS));
    }
    Ok(())
}

/// One mount: what its daemon says, with `state` running; or what the mount table knows, with
/// the reason no daemon answered.
fn describe(m: &mountinfo::MountEntry) -> Value {
    let owner = m.user_id.unwrap_or(0);
    let mountpoint = m.mountpoint.display().to_string();
    match control::about(owner, &m.mountpoint, ANSWER_WITHIN) {
        Ok(mut about) => {
            about["mountpoint"] = json!(mountpoint);
            about["state"] = json!("running");
            about
        }
        Err(why) => {
            let log = control::log_path_of(owner, &m.mountpoint).filter(|p| p.exists()).map(|p| p.display().to_string());
            let state = match why {
                control::NoAbout::Silent(_) => "not answering".to_owned(),
                control::NoAbout::Gone(_) => format!("daemon dead: stale mount (`plyfs umount {mountpoint}` cleans it up)"),
            };
            json!({ "mountpoint": mountpoint, "lower": m.source, "stack": null, "pid": null, "transport": null, "log": log, "state": state })
        }
    }
}
