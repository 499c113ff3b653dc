//! The `/dev/fuse` loop (crates/fuse/src/devloop.rs): plyfs reads and answers the requests on
//! several threads, so one slow request never holds up the callers that do not need it, and
//! concurrent callers get their own answers. And who may use a mount: with `-o allow_root` the
//! kernel lets every user through, and the daemon must turn away all but the owner and root, on
//! both transports. (Every mount here asks for `/dev/fuse`: the suite runs with io_uring allowed.)

mod common;

use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

/// A copy_file_range between passthrough files is one request, however long: the daemon copies
/// the whole range before it answers. Meanwhile another caller's requests (an uncached getxattr,
/// a directory listing) are answered, on the default thread count and on two threads. (With
/// `-o threads=1` they wait for the copy: that is what this test catches.)
#[test]
fn a_long_request_does_not_hold_up_the_others() {
    if !is_root() {
        eprintln!("skipped: passthrough needs root");
        return;
    }
    for threads in ["threads=4", "threads=2"] {
        let m = Mount::with("null", &[threads, "io_uring=off"]);
        if !m.daemon_log().contains("file I/O: passthrough") {
            eprintln!("skipped: no passthrough here: {}", m.daemon_log());
            return;
        }
        // Big enough that the copy takes far longer than the requests beside it.
        let size: u64 = 768 << 20;
        let src = fs::File::create(m.lower_path("src")).unwrap();
        let chunk = vec![0x5au8; 1 << 20];
        for i in 0..size / chunk.len() as u64 {
            use std::os::unix::fs::FileExt;
            src.write_all_at(&chunk, i * chunk.len() as u64).unwrap();
        }
        drop(src);
        fs::write(m.path("other"), b"x").unwrap();

        let copying = Arc::new(AtomicBool::new(true));
        let (from, to) = (m.path("src"), m.path("dst"));
        let flag = copying.clone();
        let copier = std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let (a, b) = (fs::File::open(from).unwrap(), fs::File::create(to).unwrap());
            let start = Instant::now();
            let mut done = 0u64;
            while done < size {
                let n = unsafe {
                    libc::copy_file_range(a.as_raw_fd(), std::ptr::null_mut(), b.as_raw_fd(), std::ptr::null_mut(), (size - done) as usize, 0)
                };
                assert!(n > 0, "copy_file_range: {}", std::io::Error::last_os_error());
                done += n as u64;
            }
            flag.store(false, Ordering::SeqCst);
            start.elapsed()
        });
        // Wait until the copy is under way in the daemon.
        std::thread::sleep(Duration::from_millis(30));
        let other = cpath(&m.path("other"));
        let mut served_meanwhile = 0;
        while copying.load(Ordering::SeqCst) && served_meanwhile < 20 {
            // Neither is answered from the kernel's caches.
            let got = unsafe { libc::lgetxattr(other.as_ptr(), c"user.absent".as_ptr(), std::ptr::null_mut(), 0) };
            assert!(got < 0 && errno() == libc::ENODATA, "getxattr: {}", std::io::Error::last_os_error());
            fs::read_dir(&m.mnt).unwrap().count();
            if copying.load(Ordering::SeqCst) {
                served_meanwhile += 1;
            }
        }
        let took = copier.join().unwrap();
        assert_eq!(fs::metadata(m.path("dst")).unwrap().len(), size);
        if took < Duration::from_millis(100) {
            eprintln!("skipped: the lower copied {size} bytes in {took:?} (a clone), too fast to judge");
            return;
        }
        assert!(
            served_meanwhile >= 20,
            "{threads}: only {served_meanwhile} rounds of requests were answered during a copy of {took:?}: they waited for it"
        );
    }
}

/// Two callers at once, each with its own tree, many times over: every answer is right,
/// whichever thread reads it.
#[test]
fn concurrent_callers_get_their_own_answers() {
    let m = Mount::with("null", &["attr_timeout=0", "entry_timeout=0", "io_uring=off"]);
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let dir = m.path(&format!("w{w}"));
            std::thread::spawn(move || {
                fs::create_dir(&dir).unwrap();
                for i in 0..300 {
                    let f = dir.join(format!("f{i}"));
                    let body = format!("{w}:{i}").repeat(i % 7 + 1);
                    fs::write(&f, &body).unwrap();
                    assert_eq!(fs::read_to_string(&f).unwrap(), body);
                    assert_eq!(fs::metadata(&f).unwrap().len(), body.len() as u64);
                    if i % 3 == 0 {
                        fs::remove_file(&f).unwrap();
                    }
                }
                assert_eq!(fs::read_dir(&dir).unwrap().count(), 200);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
}

/// `-o allow_root`: root (the owner here) and no one else. `-o allow_other`: everyone.
#[test]
fn allow_root_turns_other_users_away() {
    if !is_root() {
        eprintln!("skipped: needs root to act as another user");
        return;
    }
    assert_allow_root_refuses_others(&["io_uring=off"]);
}
