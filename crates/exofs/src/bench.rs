//! `plyfs exodisk bench`: the thesis's micro-benchmarks (Grimm, chapter 5) against a served
//! volume, one group at a time. Each measurement is a [`Sample`], which `plyfs` prints as one
//! line `group,config,metric,value`; `bench/bench exodisk` runs them several times and reports
//! medians.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use plyfs_exodisk::client::Client;
use plyfs_exodisk::core::{ExoError, Persistence, Target};
use plyfs_exodisk::object::Caps;
use plyfs_exodisk::proto::{wcap, IoReq, Reply, Request, WPersistence, WTarget};
use crate::format::Inode;
use crate::fs::Fs;
use crate::Error;
use plyfs_stack::FileKind;

const SECTOR: usize = 512;

/// One measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub group: String,
    pub config: String,
    pub metric: String,
    pub value: f64,
}

/// The measurements of a run, in the order they were taken.
#[derive(Default)]
struct Samples(std::cell::RefCell<Vec<Sample>>);

impl Samples {
    fn emit(&self, group: &str, config: &str, metric: &str, value: f64) {
        let sample = Sample { group: group.into(), config: config.into(), metric: metric.into(), value };
        self.0.borrow_mut().push(sample);
    }
}

fn ms_per(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1000.0 / n as f64
}

/// `map_err(exo(c, "benchmark small"))`: a request's error, naming the service and the benchmark.
fn exo<'a>(c: &'a Client, op: &'static str) -> impl Fn(ExoError) -> Error + Copy + 'a {
    move |source| Error::Exo { socket: c.socket().to_owned(), op, source }
}

/// [`exo`] for an operation on a file of exofs.
fn fs_err<'a>(fs: &'a Fs, op: &'static str) -> impl Fn(plyfs_stack::Error) -> Error + Copy + 'a {
    move |source| Error::Fs { socket: fs.socket().to_owned(), op, source }
}

fn batch(c: &Client, reqs: Vec<Request>) -> Result<Vec<Reply>, Error> {
    match c.batch(reqs) {
        (done, None) => Ok(done),
        (_, Some(x)) => Err(exo(c, "benchmark small: a batch of requests")(x)),
    }
}

/// Room for `sectors` sectors somewhere on the volume.
fn room(c: &Client, sectors: u64) -> Result<u64, Error> {
    let map = c.free_map().map_err(exo(c, "reading the free map"))?;
    map.find_free(sectors, c.data_start).ok_or_else(|| Error::NoRoom { socket: c.socket().to_owned(), sectors })
}

/// Run the benchmarks of `group` against the volume served at `socket`.
pub fn run(socket: &Path, group: &str, files: usize, size: usize) -> Result<Vec<Sample>, Error> {
    let c = Client::connect(socket, 16 << 20)?;
    let out = Samples::default();
    match group {
        "small" => small(&out, &c, files, size),
        "large" => large(&out, &c, socket, size),
        "two" => two(&out, socket, files, size),
        "insert" => insert(&out, socket),
        "ddio" => ddio(&out, &c),
        "persist" => persist(&out, &c, socket, files, size),
        _ => Err(Error::UnknownGroup { group: group.to_owned() }),
    }?;
    Ok(out.0.into_inner())
}

/// FILES files of SIZE bytes: allocated and written, read, deallocated, as self-protected
/// extents, as extents of exonodes, and on the raw path (one extent made beforehand, the files
/// at fixed places in it: only the service's access check, no allocation). Allocation and
/// writes are batched the same way for all three.
fn small(out: &Samples, c: &Client, files: usize, size: usize) -> Result<(), Error> {
    let e = exo(c, "benchmark small");
    let sectors = size.div_ceil(SECTOR) as u64;
    let data: Vec<u8> = (0..sectors as usize * SECTOR).map(|i| (i % 253) as u8).collect();
    let caps = Caps::random();
    let read_all = |targets: &[(Target, u64)]| -> Result<Duration, Error> {
        let mut buf = vec![0u8; data.len()];
        let t0 = Instant::now();
        for (t, at) in targets {
            c.read(t, caps.read, *at, &mut buf).map_err(e)?;
        }
        Ok(t0.elapsed())
    };
    // Raw.
    {
        let base = room(c, 1 + files as u64 * sectors)?;
        c.extent_allocate(base, 1 + files as u64 * sectors, caps, Persistence::Metadata).map_err(e)?;
        let t = Target::Extent(base);
        let places: Vec<(Target, u64)> = (0..files as u64).map(|i| (t.clone(), base + 1 + i * sectors)).collect();
        let pieces: Vec<(Target, u128, u64, &[u8])> = places.iter().map(|(t, at)| (t.clone(), caps.write, *at, &data[..])).collect();
        let t0 = Instant::now();
        c.write_many(&pieces).map_err(e)?;
        out.emit("small", "raw", "alloc_write_ms", ms_per(t0.elapsed(), files));
        out.emit("small", "raw", "read_ms", ms_per(read_all(&places)?, files));
        out.emit("small", "raw", "dealloc_ms", 0.0);
        c.extent_deallocate(base, caps.write).map_err(e)?;
    }
    // Self-protected extents: a header sector each.
    {
        let base = room(c, files as u64 * (sectors + 1))?;
        let places: Vec<(Target, u64)> =
            (0..files as u64).map(|i| base + i * (sectors + 1)).map(|x| (Target::Extent(x), x + 1)).collect();
        let t0 = Instant::now();
        let reqs = (0..files as u64)
            .map(|i| Request::ExtentAllocate {
                at: base + i * (sectors + 1),
                sectors: sectors + 1,
                caps: caps.into(),
                persistence: WPersistence::Metadata,
            })
            .collect();
        batch(c, reqs)?;
        let pieces: Vec<(Target, u128, u64, &[u8])> = places.iter().map(|(t, at)| (t.clone(), caps.write, *at, &data[..])).collect();
        c.write_many(&pieces).map_err(e)?;
        out.emit("small", "extent", "alloc_write_ms", ms_per(t0.elapsed(), files));
        out.emit("small", "extent", "read_ms", ms_per(read_all(&places)?, files));
        let t0 = Instant::now();
        let reqs =
            (0..files as u64).map(|i| Request::ExtentDeallocate { at: base + i * (sectors + 1), wcap: wcap(caps.write) }).collect();
        batch(c, reqs)?;
        out.emit("small", "extent", "dealloc_ms", ms_per(t0.elapsed(), files));
    }
    // Exonodes: the files' extents in exonodes of 64 KiB (about 3,000 each), written once
    // their entries are in (the application chooses when its metadata goes to disk).
    {
        let per = 3000usize;
        let nodes = files.div_ceil(per) as u64;
        let base = room(c, nodes * 128 + files as u64 * sectors)?;
        let data_base = base + nodes * 128;
        let t0 = Instant::now();
        for k in 0..nodes {
            c.exonode_allocate(base + k * 128, 128, caps, Persistence::Memory).map_err(e)?;
        }
        let node_of = |i: usize| Target::Exonode { at: base + (i / per) as u64 * 128, path: vec![] };
        let places: Vec<(Target, u64)> = (0..files).map(|i| (node_of(i), data_base + i as u64 * sectors)).collect();
        let reqs = places
            .iter()
            .map(|(t, at)| Request::AddExtent { target: WTarget::from(t), wcap: wcap(caps.write), idx: None, start: *at, sectors })
            .collect();
        batch(c, reqs)?;
        let pieces: Vec<(Target, u128, u64, &[u8])> = places.iter().map(|(t, at)| (t.clone(), caps.write, *at, &data[..])).collect();
        c.write_many(&pieces).map_err(e)?;
        let reqs = (0..nodes)
            .map(|k| Request::WriteRecord {
                target: WTarget::from(&Target::Exonode { at: base + k * 128, path: vec![] }),
                wcap: wcap(caps.write),
            })
            .collect();
        batch(c, reqs)?;
        out.emit("small", "exonode", "alloc_write_ms", ms_per(t0.elapsed(), files));
        out.emit("small", "exonode", "read_ms", ms_per(read_all(&places)?, files));
        let t0 = Instant::now();
        for k in 0..nodes {
            c.exonode_deallocate(&Target::Exonode { at: base + k * 128, path: vec![] }, caps.write).map_err(e)?;
        }
        out.emit("small", "exonode", "dealloc_ms", ms_per(t0.elapsed(), files));
    }
    Ok(())
}

fn attrs(kind: FileKind) -> Inode {
    Inode::new(kind, 0o644, 0, 0)
}

/// exofs in a root of its own (not a mounted file system's), emptied when done.
fn scratch_fs(socket: &Path) -> Result<Fs, Error> {
    let fs = Fs::open(Client::connect(socket, 16 << 20)?, "exofs-bench")?;
    clear(&fs)?;
    Ok(fs)
}

fn clear(fs: &Fs) -> Result<(), Error> {
    let fe = fs_err(fs, "emptying the benchmarks' root");
    let root = fs.root();
    for (name, ino) in fs.names(root).map_err(fe)? {
        let dir = fs.getattr(ino).map_err(fe)?.kind == FileKind::Dir;
        if dir {
            for (n, _) in fs.names(ino).map_err(fe)? {
                fs.remove(ino, &n, false).map_err(fe)?;
            }
        }
        fs.remove(root, &name, dir).map_err(fe)?;
    }
    fs.close().map_err(fe)
}

/// One file of SIZE bytes, sequential (1 MiB requests) and random (4 KiB), on the raw path and
/// as an exofs file.
fn large(out: &Samples, c: &Client, socket: &Path, size: usize) -> Result<(), Error> {
    let e = exo(c, "benchmark large");
    let chunk = 1 << 20;
    let size = size.div_ceil(chunk) * chunk;
    let data: Vec<u8> = (0..chunk).map(|i| (i % 251) as u8).collect();
    let mibs = |d: Duration, bytes: usize| bytes as f64 / (1 << 20) as f64 / d.as_secs_f64();
    let randoms: Vec<u64> = {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        (0..2000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % (size as u64 / 4096)
            })
            .collect()
    };
    let rand_bytes = randoms.len() * 4096;
    // Raw.
    {
        let caps = Caps::random();
        let sectors = (size / SECTOR) as u64 + 1;
        let base = room(c, sectors)?;
        c.extent_allocate(base, sectors, caps, Persistence::Metadata).map_err(e)?;
        let t = Target::Extent(base);
        let t0 = Instant::now();
        for i in 0..size / chunk {
            c.write(&t, caps.write, base + 1 + (i * chunk / SECTOR) as u64, &data).map_err(e)?;
        }
        out.emit("large", "raw", "seq_write_mibs", mibs(t0.elapsed(), size));
        let mut buf = vec![0u8; chunk];
        let t0 = Instant::now();
        for i in 0..size / chunk {
            c.read(&t, caps.read, base + 1 + (i * chunk / SECTOR) as u64, &mut buf).map_err(e)?;
        }
        out.emit("large", "raw", "seq_read_mibs", mibs(t0.elapsed(), size));
        let t0 = Instant::now();
        for r in &randoms {
            c.write(&t, caps.write, base + 1 + r * 8, &data[..4096]).map_err(e)?;
        }
        out.emit("large", "raw", "rand_write_mibs", mibs(t0.elapsed(), rand_bytes));
        let t0 = Instant::now();
        for r in &randoms {
            c.read(&t, caps.read, base + 1 + r * 8, &mut buf[..4096]).map_err(e)?;
        }
        out.emit("large", "raw", "rand_read_mibs", mibs(t0.elapsed(), rand_bytes));
        c.extent_deallocate(base, caps.write).map_err(e)?;
    }
    // exofs.
    {
        let fs = scratch_fs(socket)?;
        let fe = fs_err(&fs, "benchmark large");
        let f = fs.make(fs.root(), OsStr::new("large"), attrs(FileKind::File), b"").map_err(fe)?;
        let t0 = Instant::now();
        for i in 0..size / chunk {
            fs.write(f, (i * chunk) as u64, &data).map_err(fe)?;
        }
        fs.sync().map_err(fe)?;
        out.emit("large", "exofs", "seq_write_mibs", mibs(t0.elapsed(), size));
        let t0 = Instant::now();
        for i in 0..size / chunk {
            fs.read(f, (i * chunk) as u64, chunk).map_err(fe)?;
        }
        out.emit("large", "exofs", "seq_read_mibs", mibs(t0.elapsed(), size));
        let t0 = Instant::now();
        for r in &randoms {
            fs.write(f, r * 4096, &data[..4096]).map_err(fe)?;
        }
        out.emit("large", "exofs", "rand_write_mibs", mibs(t0.elapsed(), rand_bytes));
        let t0 = Instant::now();
        for r in &randoms {
            fs.read(f, r * 4096, 4096).map_err(fe)?;
        }
        out.emit("large", "exofs", "rand_read_mibs", mibs(t0.elapsed(), rand_bytes));
        clear(&fs)?;
    }
    Ok(())
}

/// Two clients at once, each allocating and writing, reading, randomly writing, randomly
/// reading and deallocating FILES files of SIZE bytes in exonodes (thesis §5.3): their objects
/// interleaved ten files at a time, or partitioned 250 MB apart.
fn two(out: &Samples, socket: &Path, files: usize, size: usize) -> Result<(), Error> {
    let sectors = size.div_ceil(SECTOR) as u64;
    let group = 10u64;
    let span = files as u64 * sectors + 128 * files.div_ceil(3000) as u64;
    for layout in ["partitioned", "interleaved"] {
        let probe = Client::connect(socket, 1 << 20)?;
        let gap = match layout {
            "partitioned" => (250u64 << 20) / SECTOR as u64,
            _ => 0,
        };
        let need = if gap > 0 { gap + 256 + span } else { 2 * span + 256 };
        let base = room(&probe, need)?;
        // Where client `who`'s file `i` goes, and where its exonode goes.
        let place = move |who: u64, i: u64| -> u64 {
            match layout {
                "partitioned" => base + 256 + who * gap + i * sectors,
                _ => base + 256 + ((i / group) * 2 + who) * group * sectors + (i % group) * sectors,
            }
        };
        let node_at = move |who: u64| if gap > 0 { base + who * gap } else { base + who * 128 };
        let mut handles = Vec::new();
        for who in 0..2u64 {
            let socket = socket.to_owned();
            handles.push(std::thread::spawn(move || -> Result<[Duration; 5], Error> {
                let c = Client::connect(&socket, 4 << 20)?;
                let e = exo(&c, "benchmark two");
                let caps = Caps::random();
                let data = vec![who as u8 + 1; sectors as usize * SECTOR];
                let x = Target::Exonode { at: node_at(who), path: vec![] };
                let mut times = [Duration::ZERO; 5];
                let t0 = Instant::now();
                c.exonode_allocate(node_at(who), 128, caps, Persistence::Memory).map_err(e)?;
                // Sequential: ten files per request, without waiting for the other client.
                for g in 0..(files as u64).div_ceil(group) {
                    let ids: Vec<u64> = (g * group..((g + 1) * group).min(files as u64)).collect();
                    let reqs = ids
                        .iter()
                        .map(|&i| Request::AddExtent {
                            target: WTarget::from(&x),
                            wcap: wcap(caps.write),
                            idx: None,
                            start: place(who, i),
                            sectors,
                        })
                        .collect();
                    batch(&c, reqs)?;
                    let pieces: Vec<(Target, u128, u64, &[u8])> =
                        ids.iter().map(|&i| (x.clone(), caps.write, place(who, i), &data[..])).collect();
                    c.write_many(&pieces).map_err(e)?;
                }
                times[0] = t0.elapsed();
                let mut buf = vec![0u8; data.len()];
                let t0 = Instant::now();
                for i in 0..files as u64 {
                    c.read(&x, caps.read, place(who, i), &mut buf).map_err(e)?;
                }
                times[1] = t0.elapsed();
                let mut r = 0x9E37_79B9u64 + who;
                let mut pick = || {
                    r ^= r << 13;
                    r ^= r >> 7;
                    r ^= r << 17;
                    r % files as u64
                };
                let t0 = Instant::now();
                for _ in 0..files {
                    c.write(&x, caps.write, place(who, pick()), &data).map_err(e)?;
                }
                times[2] = t0.elapsed();
                let t0 = Instant::now();
                for _ in 0..files {
                    c.read(&x, caps.read, place(who, pick()), &mut buf).map_err(e)?;
                }
                times[3] = t0.elapsed();
                let t0 = Instant::now();
                c.exonode_deallocate(&x, caps.write).map_err(e)?;
                times[4] = t0.elapsed();
                Ok(times)
            }));
        }
        let mut sum = [0f64; 5];
        for h in handles {
            let t = h.join().map_err(|_| Error::Panicked { socket: socket.to_owned(), group: "two" })??;
            for k in 0..5 {
                sum[k] += ms_per(t[k], files) / 2.0;
            }
        }
        for (k, m) in ["seq_write_ms", "seq_read_ms", "rand_write_ms", "rand_read_ms", "dealloc_ms"].iter().enumerate() {
            out.emit("two", layout, m, sum[k]);
        }
    }
    Ok(())
}

/// 16 bytes put in the middle of files of 10 KB, 100 KB and 1000 KB: exofs's indexed insert
/// against copying the second half (read it, write the bytes and it back), each made durable.
fn insert(out: &Samples, socket: &Path) -> Result<(), Error> {
    let fs = scratch_fs(socket)?;
    let fe = fs_err(&fs, "benchmark insert");
    let root = fs.root();
    let reps = 10;
    for kb in [10usize, 100, 1000] {
        let body: Vec<u8> = (0..kb * 1000).map(|i| (i % 241) as u8).collect();
        for method in ["indexed", "copy"] {
            let f = fs.make(root, OsStr::new(&format!("{method}{kb}")), attrs(FileKind::File), b"").map_err(fe)?;
            fs.write(f, 0, &body).map_err(fe)?;
            fs.sync().map_err(fe)?;
            let t0 = Instant::now();
            for _ in 0..reps {
                let size = fs.getattr(f).map_err(fe)?.size;
                let mid = size / 2;
                if method == "indexed" {
                    fs.insert(f, mid, b"sixteen bytes!!!").map_err(fe)?;
                } else {
                    let tail = fs.read(f, mid, (size - mid) as usize).map_err(fe)?;
                    let mut w = b"sixteen bytes!!!".to_vec();
                    w.extend_from_slice(&tail);
                    fs.write(f, mid, &w).map_err(fe)?;
                }
                fs.sync().map_err(fe)?;
            }
            out.emit("insert", method, &format!("ms_{kb}kb"), ms_per(t0.elapsed(), reps));
        }
    }
    clear(&fs)
}

/// Random 4 KiB reads over 200 MB, N requests outstanding at a time (N = 1, 32, 128):
/// requests per second.
fn ddio(out: &Samples, c: &Client) -> Result<(), Error> {
    let e = exo(c, "benchmark ddio");
    let caps = Caps::random();
    let sectors = (200u64 << 20) / SECTOR as u64 + 1;
    let base = room(c, sectors)?;
    c.extent_allocate(base, sectors, caps, Persistence::Metadata).map_err(e)?;
    let t = WTarget::from(&Target::Extent(base));
    let total = 4096u64;
    let mut r = 0x1234_5678_9ABC_DEF1u64;
    for n in [1u64, 32, 128] {
        let t0 = Instant::now();
        let mut done = 0;
        while done < total {
            let reqs: Vec<IoReq> = (0..n)
                .map(|k| {
                    r ^= r << 13;
                    r ^= r >> 7;
                    r ^= r << 17;
                    IoReq {
                        id: c.io_id(),
                        target: t.clone(),
                        cap: wcap(caps.read),
                        write: false,
                        sector: base + 1 + (r % ((sectors - 1) / 8)) * 8,
                        count: 8,
                        offset: k * 4096,
                    }
                })
                .collect();
            let ids: Vec<u64> = reqs.iter().map(|q| q.id).collect();
            c.submit(reqs).map_err(e)?;
            for id in ids {
                let res = c.wait_io(id);
                if res < 0 {
                    let msg = format!("a read failed: {}", std::io::Error::from_raw_os_error(-res));
                    return Err(e(ExoError { errno: -res, msg }));
                }
            }
            done += n;
        }
        out.emit("ddio", &format!("n{n}"), "requests_per_s", total as f64 / t0.elapsed().as_secs_f64());
    }
    c.extent_deallocate(base, caps.write).map_err(e)
}

/// Per-file allocation and write of FILES files of SIZE bytes under each persistence model:
/// self-protected extents of that model, and exofs files whose directory picks it.
fn persist(out: &Samples, c: &Client, socket: &Path, files: usize, size: usize) -> Result<(), Error> {
    let e = exo(c, "benchmark persist");
    let sectors = size.div_ceil(SECTOR) as u64;
    let data = vec![0x5au8; sectors as usize * SECTOR];
    for (name, model) in [("memory", Persistence::Memory), ("metadata", Persistence::Metadata), ("data", Persistence::Data)] {
        let caps = Caps::random();
        let base = room(c, files as u64 * (sectors + 1))?;
        let t0 = Instant::now();
        for i in 0..files as u64 {
            let at = base + i * (sectors + 1);
            c.extent_allocate(at, sectors + 1, caps, model).map_err(e)?;
            c.write(&Target::Extent(at), caps.write, at + 1, &data).map_err(e)?;
        }
        out.emit("persist", &format!("extent-{name}"), "ms_per_file", ms_per(t0.elapsed(), files));
        for i in 0..files as u64 {
            c.extent_deallocate(base + i * (sectors + 1), caps.write).map_err(e)?;
        }
    }
    let fs = scratch_fs(socket)?;
    let fe = fs_err(&fs, "benchmark persist");
    for name in ["memory", "metadata", "data"] {
        let d = fs.make(fs.root(), OsStr::new(name), attrs(FileKind::Dir), b"").map_err(fe)?;
        fs.set_xattr(d, b"user.exofs.persistence", Some(name.as_bytes()), 0).map_err(fe)?;
        fs.sync().map_err(fe)?;
        let t0 = Instant::now();
        for i in 0..files {
            let f = fs.make(d, OsStr::new(&format!("f{i}")), attrs(FileKind::File), b"").map_err(fe)?;
            fs.write(f, 0, &data[..size]).map_err(fe)?;
        }
        out.emit("persist", &format!("exofs-{name}"), "ms_per_file", ms_per(t0.elapsed(), files));
    }
    clear(&fs)
}
