//! The service over its socket, with clients in this process: shared-memory data, batches,
//! named roots, and what one client can and cannot do to another's objects.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use plyfs_exodisk::client::Client;
use plyfs_exodisk::core::{Persistence, Target};
use plyfs_exodisk::layout::{self, default_key_path};
use plyfs_exodisk::object::Caps;
use plyfs_exodisk::proto::{wcap, IoReq, WTarget};
use plyfs_exodisk::service::{self, Service};

struct Running {
    service: Arc<Service>,
    thread: Option<std::thread::JoinHandle<()>>,
    socket: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.service.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(dir: &Path) -> Running {
    let img = dir.join("v.img");
    if !img.exists() {
        layout::format(&img, Some(64 << 20), &default_key_path(&img)).unwrap();
    }
    let socket = dir.join("s.sock");
    let (service, _) = service::start(&img, &default_key_path(&img), &socket).unwrap();
    let s = service.clone();
    let thread = std::thread::spawn(move || s.serve().unwrap());
    for _ in 0..200 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Running { service, thread: Some(thread), socket }
}

const A: Caps = Caps { read: 0x1111, write: 0x2222 };

#[test]
fn data_moves_through_shared_memory_and_protection_holds_between_clients() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(dir.path());
    let one = Client::connect(&r.socket, 4 << 20).unwrap();
    let two = Client::connect(&r.socket, 4 << 20).unwrap();
    let at = one.free_map().unwrap().find_free(64, one.data_start + 100).unwrap();
    one.extent_allocate(at, 64, A, Persistence::Metadata).unwrap();
    let ext = Target::Extent(at);
    let data: Vec<u8> = (0..63 * 512).map(|i| (i % 251) as u8).collect();
    one.write(&ext, A.write, at + 1, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    // The other client reads with the capability, and not without it.
    two.read(&ext, A.read, at + 1, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(two.read(&ext, 0x9999, at + 1, &mut back[..512]).unwrap_err().errno, libc::EACCES);
    assert_eq!(two.write(&ext, A.read, at + 1, &data[..512]).unwrap_err().errno, libc::EACCES);
    assert_eq!(two.read(&ext, A.read, at + 64, &mut back[..512]).unwrap_err().errno, libc::EACCES);
    // Named roots: the same name is the same exonode, another name another one.
    let (r1, c1) = one.root("exofs").unwrap();
    let (r2, c2) = two.root("exofs").unwrap();
    let (r3, _) = two.root("scratch").unwrap();
    assert_eq!((r1, c1), (r2, c2));
    assert_ne!(r1, r3);
    // A batch of requests queued at once, completing in the service's order.
    let base = (2 << 20) as u64;
    let mut reqs = Vec::new();
    for i in 0..32u64 {
        one.shm().put(base + i * 512, &[i as u8; 512]).unwrap();
        reqs.push(IoReq {
            id: one.io_id(),
            target: WTarget::Extent(at),
            cap: wcap(A.write),
            write: true,
            sector: at + 1 + (i * 17) % 63,
            count: 1,
            offset: base + i * 512,
        });
    }
    let ids: Vec<u64> = reqs.iter().map(|q| q.id).collect();
    assert_eq!(one.submit(reqs).unwrap(), 32);
    assert!(ids.iter().all(|id| one.wait_io(*id) == 512));
    let (pending, _) = one.poll().unwrap();
    assert_eq!(pending, 0);
}

#[test]
fn objects_survive_a_restart_of_the_service_by_their_model() {
    let dir = tempfile::tempdir().unwrap();
    let (at, x);
    {
        let r = run(dir.path());
        let c = Client::connect(&r.socket, 2 << 20).unwrap();
        at = c.free_map().unwrap().find_free(16, c.data_start + 100).unwrap();
        c.extent_allocate(at, 8, A, Persistence::Data).unwrap();
        c.write(&Target::Extent(at), A.write, at + 1, &[5u8; 512]).unwrap();
        x = at + 8;
        c.exonode_allocate(x, 1, A, Persistence::Memory).unwrap();
        c.shutdown().unwrap();
    }
    let r = run(dir.path());
    let c = Client::connect(&r.socket, 2 << 20).unwrap();
    let mut back = [0u8; 512];
    c.read(&Target::Extent(at), A.read, at + 1, &mut back).unwrap();
    assert_eq!(back, [5u8; 512]);
    assert_eq!(c.map(&Target::Exonode { at: x, path: vec![] }, A.read).unwrap_err().errno, libc::ENOENT);
}

#[test]
fn an_exclusive_root_waits_for_its_holder_to_go() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(dir.path());
    let first = Client::connect(&r.socket, 1 << 20).unwrap();
    let held = first.root_exclusive("fs").unwrap();
    // A shared look is fine; a second exclusive holder waits until the first connection ends.
    assert_eq!(Client::connect(&r.socket, 1 << 20).unwrap().root("fs").unwrap(), held);
    let second = Client::connect(&r.socket, 1 << 20).unwrap();
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(first);
        });
        assert_eq!(second.root_exclusive("fs").unwrap(), held);
    });
    assert!(started.elapsed() >= std::time::Duration::from_millis(250));
}
