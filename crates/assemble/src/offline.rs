//! Working on a lower directory without mounting it: the stack runs in this process.
//!
//! - `plyfs encode SRC DEST --stack SPEC`: write plain files or trees in the stack's lower format;
//! - `plyfs decode LOWER DEST --stack SPEC`: the reverse;
//! - `plyfs fsck LOWER --stack SPEC`: verify every file, rebuilding damaged indexes;
//! - `plyfs du PATH [--stack SPEC]`: decoded size against space used, per entry.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use plyfs_layers::transfer::{for_each_data_extent, read_range, seek_fd, seek_level};
use plyfs_stack::lowerlock::LowerLock;
use plyfs_stack::{Caller, Entry, FileKind, Level, NodeId, Op, SetAttr, Stack, TimeSet};

use crate::Error;

type Res<T> = crate::Result<T>;

/// Build the stack `spec` over `lower`, in process, holding the lower locks of `plyfs
/// COMMAND` (which `writes` the lower or only reads it) while the stack is in use.
pub fn open_stack(lower: &Path, spec: &str, branches: &[String], command: &str, writes: bool) -> Res<(Stack, Vec<LowerLock>)> {
    let specs = plyfs_stack::spec::parse_stack_spec(spec).map_err(|e| Error::Spec(e.to_string()))?;
    let who = format!("running plyfs {command}");
    let locks = crate::locks::take_all(Some(lower), branches, &specs, crate::locks::Use::Tool { writes }, &who)?;
    // The same stack as a mount: each file is read through the chain recorded with it, and a
    // tree's branches are built as the mount builds them.
    let stack = crate::tree::build_stack(&specs, &crate::lower::Lower::Dir(lower.to_owned()), branches, None, None)?;
    Ok((stack, locks))
}

fn cx() -> Caller {
    Caller::daemon()
}

/// How an offline tool shows how far it is and what it found: the `plyfs` binary draws a bar
/// on a terminal, with the notes above it.
pub trait Progress {
    /// Work over `total` bytes begins (`what`: "encoding", "checking"...).
    fn start(&self, what: &str, total: u64);
    /// `bytes` more are done.
    fn advance(&self, bytes: u64);
    /// A line for the user about one file ("PATH: repaired: ..."), shown as it is found.
    fn note(&self, line: &str);
    /// The file being worked on now.
    fn item(&self, _name: &str) {}
    /// A line of the work's result ("PATH: FROM -> TO"), shown as it comes.
    fn result(&self, line: &str) {
        self.note(line)
    }
    /// The work is over, done or failed.
    fn finish(&self);
}

/// Progress that goes nowhere, for callers that show none.
pub struct Quiet;

impl Progress for Quiet {
    fn start(&self, _: &str, _: u64) {}
    fn advance(&self, _: u64) {}
    fn note(&self, _: &str) {}
    fn finish(&self) {}
}

/// `name` in `parent`; errors name it as `shown`.
fn lookup(level: &Level, parent: NodeId, name: &OsStr, shown: &Path) -> Res<Entry> {
    level.lookup(&cx(), parent, name).map_err(|e| Error::file(shown, "looking up", e))
}

/// The node at `rel` (relative to the root), looked up one component at a time. Every lookup
/// but the last is forgotten again.
fn resolve(level: &Level, rel: &Path) -> Res<Entry> {
    let mut entry = Entry { node: NodeId::ROOT, attr: level.getattr(&cx(), NodeId::ROOT).map_err(|e| Error::file("/", "reading attributes", e))?, generation: 0 };
    let mut held: Option<NodeId> = None;
    for part in rel.components() {
        let std::path::Component::Normal(name) = part else { continue };
        let next = lookup(level, entry.node, name, rel)?;
        if let Some(prev) = held.replace(next.node) {
            level.forget(&cx(), prev, 1);
        }
        entry = next;
    }
    Ok(entry)
}

/// Visit every object below `dir` (depth first, parents before children) with its path
/// relative to the walk's root.
fn walk(level: &Level, dir: NodeId, rel: &Path, visit: &mut dyn FnMut(&Path, &Entry) -> Res<()>) -> Res<()> {
    let entries = level.list_dir(&cx(), dir).map_err(|e| Error::file(rel, "listing", e))?;
    for d in entries {
        let path = rel.join(&d.name);
        let entry = lookup(level, dir, &d.name, &path)?;
        let result = visit(&path, &entry).and_then(|()| match entry.attr.kind {
            FileKind::Dir => walk(level, entry.node, &path, visit),
            _ => Ok(()),
        });
        level.forget(&cx(), entry.node, 1);
        result?;
    }
    Ok(())
}

fn time_set(t: SystemTime) -> Option<TimeSet> {
    Some(TimeSet::At(t))
}

/// Give `node` the mode, owner (when running as root) and times of `meta`.
fn copy_attrs_in(level: &Level, node: NodeId, meta: &fs::Metadata, is_link: bool) -> plyfs_stack::Result<()> {
    let root = unsafe { libc::geteuid() } == 0;
    let set = SetAttr {
        mode: (!is_link).then_some(meta.mode() & 0o7777),
        uid: root.then_some(meta.uid()),
        gid: root.then_some(meta.gid()),
        size: None,
        atime: meta.accessed().ok().and_then(time_set),
        mtime: meta.modified().ok().and_then(time_set),
    };
    level.call(&cx(), &Op::SetAttr { node, fh: None, set }).map(|_| ())
}

/// The lower directory `encode` writes into: `dest` for a tree, its parent for a file.
pub fn encode_root(src: &Path, dest: &Path) -> PathBuf {
    if fs::metadata(src).is_ok_and(|m| m.is_dir()) {
        dest.to_path_buf()
    } else {
        dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
    }
}

/// Write plain `src` (a file or a tree) into `dest` in the lower format of `spec`; returns the
/// plain bytes written.
pub fn encode(src: &Path, dest: &Path, spec: &str, bar: &dyn Progress) -> Res<u64> {
    let meta = fs::symlink_metadata(src).map_err(|e| Error::path("", src, e))?;
    let (lower_root, name) = if meta.is_dir() {
        // A crypt volume made for it holds its configuration already, and a lower once used its
        // lock file.
        let config = OsStr::new(plyfs_layers::crypt::keys::CONFIG_NAME);
        let ours = |name: &OsStr| name == config || plyfs_stack::lowerlock::is_lock_file(name);
        match fs::read_dir(dest).map(|mut d| d.any(|e| e.map_or(true, |e| !ours(&e.file_name())))) {
            Ok(true) => return Err(Error::path("", dest, "not empty; encode into a new or empty directory")),
            Ok(false) => {}
            Err(_) => fs::create_dir_all(dest).map_err(|e| Error::path("", dest, e))?,
        }
        (dest.to_path_buf(), None)
    } else {
        if fs::symlink_metadata(dest).is_ok() {
            return Err(Error::path("", dest, "already exists"));
        }
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = dest.file_name().ok_or_else(|| Error::path("", dest, "not a file name"))?;
        (parent.to_path_buf(), Some(name.to_owned()))
    };
    let (stack, _locks) = open_stack(&lower_root, spec, &[], "encode", true)?;
    let top = stack.top().clone();
    let (total, _) = plain_usage(src);
    bar.start("encoding", total);
    let mut links = HashMap::new();
    let result = match &name {
        Some(name) => encode_one(&top, NodeId::ROOT, name, src, &meta, bar, &mut links),
        None => encode_tree(&top, NodeId::ROOT, src, bar, &mut links)
            .and_then(|()| copy_attrs_in(&top, NodeId::ROOT, &meta, false).map_err(|e| Error::file(src, "setting attributes", e))),
    };
    stack.shutdown();
    bar.finish();
    result?;
    Ok(total)
}

fn encode_tree(top: &Level, dir: NodeId, src: &Path, bar: &dyn Progress, links: &mut HashMap<(u64, u64), NodeId>) -> Res<()> {
    let mut entries: Vec<_> = fs::read_dir(src).map_err(|e| Error::path("", src, e))?.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let meta = fs::symlink_metadata(&path).map_err(|err| Error::path("", &path, err))?;
        encode_one(top, dir, &e.file_name(), &path, &meta, bar, links)?;
    }
    Ok(())
}

fn encode_one(
    top: &Level,
    parent: NodeId,
    name: &OsStr,
    src: &Path,
    meta: &fs::Metadata,
    bar: &dyn Progress,
    links: &mut HashMap<(u64, u64), NodeId>,
) -> Res<()> {
    let at = |op: &'static str| move |e: plyfs_stack::Error| Error::file(src, op, e);
    let ft = meta.file_type();
    if meta.nlink() > 1 && !ft.is_dir() {
        if let Some(&first) = links.get(&(meta.dev(), meta.ino())) {
            top.call(&cx(), &Op::Link { node: first, new_parent: parent, new_name: name }).map_err(at("linking"))?;
            top.forget(&cx(), first, 1);
            bar.advance(meta.len());
            return Ok(());
        }
    }
    let entry = if ft.is_dir() {
        let e = top.mkdir(&cx(), parent, name, 0o700).map_err(at("making the directory"))?;
        encode_tree(top, e.node, src, bar, links)?;
        e
    } else if ft.is_symlink() {
        let target = fs::read_link(src).map_err(|e| Error::path("", src, e))?;
        match top.call(&cx(), &Op::SymLink { parent, name, target: &target }).map_err(at("making the symlink"))? {
            plyfs_stack::Reply::Entry(e) => e,
            _ => return Err(Error::file(src, "making the symlink", "no entry came back")),
        }
    } else if ft.is_file() {
        let (e, opened) = top.create(&cx(), parent, name, 0o600, libc::O_WRONLY | libc::O_EXCL).map_err(at("creating"))?;
        let copied = copy_into(top, e.node, opened.fh, src, bar);
        let released = top.release(&cx(), e.node, opened.fh).map_err(at("closing"));
        copied.and(released)?;
        e
    } else {
        let mode = meta.mode();
        match top.call(&cx(), &Op::MkNod { parent, name, mode, rdev: meta.rdev() as u32 }).map_err(at("making the node"))? {
            plyfs_stack::Reply::Entry(e) => e,
            _ => return Err(Error::file(src, "making the node", "no entry came back")),
        }
    };
    copy_attrs_in(top, entry.node, meta, ft.is_symlink()).map_err(|e| Error::file(src, "setting attributes", e))?;
    if meta.nlink() > 1 && !ft.is_dir() {
        links.insert((meta.dev(), meta.ino()), entry.node);
    } else {
        top.forget(&cx(), entry.node, 1);
    }
    Ok(())
}

/// The plain file `src` into the stack's open file `node`, holes kept.
fn copy_into(top: &Level, node: NodeId, fh: plyfs_stack::FileHandle, src: &Path, bar: &dyn Progress) -> Res<()> {
    let f = fs::File::open(src).map_err(|e| Error::path("", src, e))?;
    let size = f.metadata().map_err(|e| Error::path("", src, e))?.len();
    let mut buf = vec![0u8; 1 << 20];
    let mut data_bytes = 0;
    let copied = for_each_data_extent(size, seek_fd(f.as_raw_fd()), |start, end| {
        let mut off = start;
        while off < end {
            let n = f.read_at(&mut buf[..(end - off).min(1 << 20) as usize], off)?;
            if n == 0 {
                break;
            }
            top.write(&cx(), node, fh, off, &buf[..n])?;
            off += n as u64;
            data_bytes += n as u64;
            bar.advance(n as u64);
        }
        Ok(())
    });
    copied.and_then(|()| set_length(top, node, fh, size)).map_err(|e| Error::file(src, "writing", e))?;
    // The holes count as done.
    bar.advance(size.saturating_sub(data_bytes));
    Ok(())
}

/// Give the open file `node` of `top` its length: the holes at its end are no data to write.
fn set_length(top: &Level, node: NodeId, fh: plyfs_stack::FileHandle, size: u64) -> plyfs_stack::Result<()> {
    let length = SetAttr { size: Some(size), ..SetAttr::default() };
    top.call(&cx(), &Op::SetAttr { node, fh: Some(fh), set: length }).map(|_| ())
}

/// Write the decoded contents of `lower` (all of it, or `--path` within it) into `dest`; returns
/// the plain bytes written.
pub fn decode(lower: &Path, dest: &Path, spec: &str, branches: &[String], sub: Option<&Path>, bar: &dyn Progress) -> Res<u64> {
    if fs::symlink_metadata(dest).is_ok() {
        return Err(Error::path("", dest, "already exists; decode into a new path"));
    }
    let (stack, _locks) = open_stack(lower, spec, branches, "decode", false)?;
    let top = stack.top().clone();
    let start = resolve(&top, sub.unwrap_or(Path::new("")))?;
    let mut total = 0;
    if start.attr.kind == FileKind::Dir {
        walk(&top, start.node, Path::new(""), &mut |_, e| {
            if e.attr.kind == FileKind::File {
                total += e.attr.size;
            }
            Ok(())
        })?;
    } else {
        total = start.attr.size;
    }
    bar.start("decoding", total);
    let result = decode_one(&top, &start, dest, bar);
    let result = result.and_then(|()| {
        if start.attr.kind != FileKind::Dir {
            return Ok(());
        }
        let mut dirs = Vec::new();
        let mut links: HashMap<NodeId, std::path::PathBuf> = HashMap::new();
        walk(&top, start.node, Path::new(""), &mut |rel, e| {
            let out = dest.join(rel);
            if e.attr.nlink > 1 && e.attr.kind != FileKind::Dir {
                if let Some(first) = links.get(&e.node) {
                    bar.advance(e.attr.size);
                    return fs::hard_link(first, &out).map_err(|err| Error::path("", &out, err));
                }
                links.insert(e.node, out.clone());
            }
            decode_one(&top, e, &out, bar)?;
            if e.attr.kind == FileKind::Dir {
                dirs.push((out, e.attr));
            }
            Ok(())
        })?;
        // Directory times last, once nothing more is written into them.
        for (out, attr) in dirs.iter().rev().chain(std::iter::once(&(dest.to_path_buf(), start.attr))) {
            set_plain_attrs(out, &attr_meta(attr), false)?;
        }
        Ok(())
    });
    stack.shutdown();
    bar.finish();
    result?;
    Ok(total)
}

struct PlainAttrs {
    mode: u32,
    uid: u32,
    gid: u32,
    atime: SystemTime,
    mtime: SystemTime,
}

fn attr_meta(a: &plyfs_stack::Attr) -> PlainAttrs {
    PlainAttrs { mode: a.perm.into(), uid: a.uid, gid: a.gid, atime: a.atime, mtime: a.mtime }
}

fn set_plain_attrs(path: &Path, a: &PlainAttrs, is_link: bool) -> Res<()> {
    let at = |e: std::io::Error| Error::path("", path, e);
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::lchown(path, Some(a.uid), Some(a.gid)).map_err(at)?;
    }
    if !is_link {
        fs::set_permissions(path, fs::Permissions::from_mode(a.mode)).map_err(at)?;
    }
    // By path, without opening: a symlink keeps its own times (not its target's), and a FIFO
    // or a device is not opened.
    set_times_nofollow(path, a.atime, a.mtime).map_err(at)
}

/// `utimensat(2)` with `AT_SYMLINK_NOFOLLOW`.
fn set_times_nofollow(path: &Path, atime: SystemTime, mtime: SystemTime) -> std::io::Result<()> {
    let timespec = |t: SystemTime| {
        let (secs, nanos) = plyfs_stack::unix_time(t);
        libc::timespec { tv_sec: secs, tv_nsec: i64::from(nanos) }
    };
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let times = [timespec(atime), timespec(mtime)];
    if unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn decode_one(top: &Level, e: &Entry, out: &Path, bar: &dyn Progress) -> Res<()> {
    let at = |op: &'static str| move |err: plyfs_stack::Error| Error::file(out, op, err);
    match e.attr.kind {
        FileKind::Dir => fs::create_dir(out).map_err(|err| Error::path("", out, err)),
        FileKind::Symlink => {
            let target = match top.call(&cx(), &Op::ReadLink { node: e.node }).map_err(at("reading the link"))? {
                plyfs_stack::Reply::Data(d) => d,
                _ => return Err(Error::file(out, "reading the link", "no target came back")),
            };
            std::os::unix::fs::symlink(OsStr::from_bytes(&target), out).map_err(|err| Error::path("", out, err))?;
            set_plain_attrs(out, &attr_meta(&e.attr), true)
        }
        FileKind::File => {
            let opened = top.open(&cx(), e.node, libc::O_RDONLY).map_err(at("opening"))?;
            // Only the data the stack holds is written, so the decoded file keeps its holes.
            let copied = (|| -> Res<()> {
                let f = fs::File::create(out).map_err(|err| Error::path("", out, err))?;
                let file = (e.node, opened.fh);
                let mut data_bytes = 0;
                for_each_data_extent(e.attr.size, seek_level(top, e.node, opened.fh), |start, end| {
                    read_range(top, file, start, end, |off, data| {
                        data_bytes += data.len() as u64;
                        bar.advance(data.len() as u64);
                        Ok(f.write_all_at(data, off)?)
                    })
                })
                .map_err(at("decoding"))?;
                f.set_len(e.attr.size).map_err(|err| Error::path("", out, err))?;
                // The holes count as done.
                bar.advance(e.attr.size.saturating_sub(data_bytes));
                Ok(())
            })();
            let _ = top.release(&cx(), e.node, opened.fh);
            copied?;
            set_plain_attrs(out, &attr_meta(&e.attr), false)
        }
        _ => {
            let kind = match e.attr.kind {
                FileKind::Fifo => libc::S_IFIFO,
                FileKind::Socket => libc::S_IFSOCK,
                FileKind::CharDevice => libc::S_IFCHR,
                _ => libc::S_IFBLK,
            };
            let c = std::ffi::CString::new(out.as_os_str().as_bytes()).map_err(|err| Error::path("", out, err))?;
            if unsafe { libc::mknod(c.as_ptr(), kind | u32::from(e.attr.perm), e.attr.rdev.into()) } != 0 {
                return Err(Error::path("", out, std::io::Error::last_os_error()));
            }
            set_plain_attrs(out, &attr_meta(&e.attr), false)
        }
    }
}

/// Verify every file of `lower` through the stack. Opening a file rebuilds a damaged index
/// (logged); files whose data is damaged are listed and make the result an error. With
/// `rebind`, each file of a crypt volume that binds files to their places is first bound to
/// where it is.
pub fn fsck(lower: &Path, spec: &str, branches: &[String], rebind: bool, bar: &dyn Progress) -> Res<Checked> {
    let (stack, _locks) = open_stack(lower, spec, branches, "fsck", true)?;
    let stack = Arc::new(stack);
    let top = stack.top().clone();
    let mut files = Vec::new();
    walk(&top, NodeId::ROOT, Path::new(""), &mut |rel, e| {
        if e.attr.kind == FileKind::File {
            files.push((rel.to_path_buf(), e.attr.size));
        }
        Ok(())
    })?;
    bar.start("checking", files.iter().map(|f| f.1).sum());
    // The layers name a lower file by its absolute path.
    let lower_abs = lower.canonicalize().unwrap_or_else(|_| lower.to_owned());
    let mut damaged = Vec::new();
    // Files encoded with other layers than the stack gives: (recorded, policy, its source) →
    // (how many, the first found), said once per kind after the check.
    let mut other_chains: BTreeMap<(String, String, String), (usize, PathBuf)> = BTreeMap::new();
    let mut plain = 0usize;
    let mut repaired = 0usize;
    let mut rebound = 0usize;
    for (rel, size) in &files {
        let outcome = resolve(&top, rel).and_then(|e| {
            if rebind {
                match top.extended(&cx(), e.node, plyfs_layers::crypt::names::REBIND_OP, &[]) {
                    Ok(v) if v["rebound"] == true => {
                        bar.note(&format!("{}: bound to where it is now", rel.display()));
                        rebound += 1;
                    }
                    Ok(_) => {}
                    Err(err) => {
                        top.forget(&cx(), e.node, 1);
                        return Err(Error::file(rel, "binding to its place (--rebind)", stack.explain(err)));
                    }
                }
            }
            let v = top.extended(&cx(), e.node, "verify", &[]);
            if v.is_ok() {
                if let Some(chains) = other_chain(&top, e.node) {
                    other_chains.entry(chains).or_insert((0, rel.to_path_buf())).0 += 1;
                }
            }
            top.forget(&cx(), e.node, 1);
            match v {
                // A file that no size-changing layer encodes (its chain is `none`): nothing to check.
                Err(plyfs_stack::Error::UnsupportedOp { .. }) => Ok(None),
                Err(err) => Err(Error::file(rel, "verifying", stack.explain(err))),
                Ok(v) => Ok(Some(v)),
            }
        });
        match outcome {
            Ok(None) => plain += 1,
            Ok(Some(v)) if v.get("ok").and_then(|o| o.as_bool()) == Some(true) => {
                if let Some(why) = v.get("index_rebuilt").and_then(|w| w.as_str()) {
                    bar.note(&format!("{}: repaired: the index was inconsistent ({why}); rebuilt from the data", rel.display()));
                    repaired += 1;
                }
            }
            Ok(Some(v)) => {
                bar.note(&damage_line(rel, &lower_abs.join(rel), &v));
                if v.get("index_rebuilt").is_some_and(|w| w.is_string()) {
                    repaired += 1;
                }
                damaged.push(rel.clone());
            }
            Err(e) => {
                bar.note(&e.to_string());
                damaged.push(rel.clone());
            }
        }
        bar.advance(*size);
    }
    stack.shutdown();
    for ((recorded, policy, source), (count, first)) in &other_chains {
        let (which, read) = match count {
            1 => (format!("{}: encoded", first.display()), "it is read with"),
            n => (format!("{n} files (the first: {}) are encoded", first.display()), "each is read with"),
        };
        bar.note(&format!(
            "warning: {which} with '{recorded}', while {source} gives '{policy}'; {read} '{recorded}', as it records (`plyfs policy apply` re-encodes it)"
        ));
    }
    bar.finish();
    Ok(Checked { checked: files.len() - plain, plain, repaired, rebound, damaged })
}

/// The one line `fsck` gives a damaged file: its path, the first problem the layers found (less
/// the lower path they name it by), how many more, and whether its index was rebuilt.
fn damage_line(rel: &Path, lower_file: &Path, verified: &serde_json::Value) -> String {
    let problems: Vec<&str> =
        verified.get("problems").and_then(|p| p.as_array()).map(|a| a.iter().filter_map(|p| p["error"].as_str()).collect()).unwrap_or_default();
    let named = format!("{}: ", lower_file.display());
    let first = problems.first().map(|p| p.strip_prefix(&named).unwrap_or(p)).unwrap_or("damaged");
    let more = match problems.len() {
        0 | 1 => String::new(),
        n => format!(" (and {} more damaged chunks)", n - 1),
    };
    let rebuilt = if verified.get("index_rebuilt").is_some_and(|w| w.is_string()) { "; its index was rebuilt" } else { "" };
    format!("{}: {first}{more}{rebuilt}", rel.display())
}

/// The chain the file at `node` is encoded with, the one its policy gives and where that comes
/// from, when their layers differ (it was written under another `--stack` or rule): the mount
/// reads it with the chain it records, and so `fsck` checks it, but the user may think it is in
/// another format.
fn other_chain(top: &Level, node: NodeId) -> Option<(String, String, String)> {
    let explained = top.extended(&cx(), node, "policy-explain", &[]).ok()?;
    let (recorded, policy) = (explained["recorded"].as_str()?, explained["policy"].as_str()?);
    let source = explained["source"].as_str().unwrap_or("its policy");
    // Only another codec or cipher is worth a word: a file written with other parameters of the
    // same layers (a chunk size, a level) is simply read with them.
    // (A text that does not parse is compared whole.)
    let kinds = |chain: &str| match plyfs_policy::Policy::parse(chain) {
        Ok(p) => p.specs().iter().map(|s| s.kind.clone()).collect(),
        Err(_) => vec![chain.to_owned()],
    };
    (kinds(recorded) != kinds(policy)).then(|| (recorded.to_owned(), policy.to_owned(), source.to_owned()))
}

/// What `fsck` found.
#[derive(Debug)]
pub struct Checked {
    /// Files checked (plain files excepted).
    pub checked: usize,
    /// Plain files, which no layer encodes: nothing to check.
    pub plain: usize,
    /// Files whose index was rebuilt from their data.
    pub repaired: usize,
    /// Files bound anew to where they are (`--rebind`).
    pub rebound: usize,
    /// Files whose data is damaged, relative to the lower directory.
    pub damaged: Vec<PathBuf>,
}

/// Decoded bytes against the space used, for each entry of `path` and in total. With a stack,
/// `path` is a lower directory read in process; without, a directory inside a mount. Each row is
/// (name, decoded bytes, bytes stored), a directory's name ending in `/`.
pub fn du(path: &Path, spec: Option<&str>, branches: &[String]) -> Res<Vec<(String, u64, u64)>> {
    let mut rows: Vec<(String, u64, u64)> = Vec::new();
    match spec {
        None => {
            let mut entries: Vec<_> = fs::read_dir(path).map_err(|e| Error::path("", path, e))?.flatten().collect();
            entries.sort_by_key(|e| e.file_name());
            for e in entries {
                let (decoded, stored) = plain_usage(&e.path());
                rows.push((display_name(&e.file_name(), e.path().is_dir()), decoded, stored));
            }
        }
        Some(spec) => {
            let (stack, _locks) = open_stack(path, spec, branches, "du", false)?;
            let top = stack.top().clone();
            let bottom = stack.levels().last().expect("bottom").clone();
            for d in top.list_dir(&cx(), NodeId::ROOT).map_err(|e| Error::file(path, "listing", e))? {
                let e = lookup(&top, NodeId::ROOT, &d.name, Path::new(&d.name))?;
                let (mut decoded, mut stored) = usage_of(&bottom, &e);
                if e.attr.kind == FileKind::Dir {
                    walk(&top, e.node, Path::new(""), &mut |_, inner| {
                        let (a, b) = usage_of(&bottom, inner);
                        decoded += a;
                        stored += b;
                        Ok(())
                    })?;
                }
                top.forget(&cx(), e.node, 1);
                rows.push((display_name(&d.name, e.attr.kind == FileKind::Dir), decoded, stored));
            }
            stack.shutdown();
        }
    }
    Ok(rows)
}

fn display_name(name: &OsStr, dir: bool) -> String {
    format!("{}{}", name.to_string_lossy(), if dir { "/" } else { "" })
}

/// (decoded size, space used) of one object seen through the stack: the decoded size from
/// the top, the blocks from the bottom.
fn usage_of(bottom: &Level, e: &Entry) -> (u64, u64) {
    let stored = bottom.getattr(&cx(), e.node).map_or(e.attr.blocks * 512, |a| a.blocks * 512);
    let decoded = if e.attr.kind == FileKind::File { e.attr.size } else { 0 };
    (decoded, stored)
}

/// (sizes, blocks) under a path on a mounted file system, where sizes are already decoded.
fn plain_usage(path: &Path) -> (u64, u64) {
    let Ok(m) = fs::symlink_metadata(path) else { return (0, 0) };
    let mut total = (if m.is_file() { m.len() } else { 0 }, m.blocks() * 512);
    if m.is_dir() {
        for e in fs::read_dir(path).into_iter().flatten().flatten() {
            let (a, b) = plain_usage(&e.path());
            total = (total.0 + a, total.1 + b);
        }
    }
    total
}
