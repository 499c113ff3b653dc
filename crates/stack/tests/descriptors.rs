//! Every operation's descriptor, as layers and logs see it (`trace` writes it out as JSON): its
//! name, kind and arguments, and the same after `at` and `on_open` readdress it. The operations
//! are declared once (`op/mod.rs`); these lines hold what that declaration gives.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use plyfs_stack::*;

/// One of each operation (two of `getattr` and `setattr`).
fn samples<'a>(args: &'a [String], data: &'a [u8]) -> Vec<Op<'a>> {
    let n = NodeId(2);
    let p = NodeId(1);
    let fh = FileHandle(5);
    let name = OsStr::new("a\u{e9}");
    vec![
        Op::Lookup { parent: p, name },
        Op::Forget { node: n, nlookup: 3 },
        Op::GetAttr { node: n, fh: None },
        Op::GetAttr { node: n, fh: Some(fh) },
        Op::SetAttr { node: n, fh: Some(fh), set: SetAttr { mode: Some(0o644), uid: None, gid: Some(7), size: Some(100), atime: Some(TimeSet::Now), mtime: Some(TimeSet::At(UNIX_EPOCH + Duration::new(5, 3))) } },
        Op::SetAttr { node: n, fh: None, set: SetAttr { mode: None, uid: Some(1), gid: None, size: None, atime: None, mtime: None } },
        Op::ReadLink { node: n },
        Op::MkNod { parent: p, name, mode: 0o20644, rdev: 5 },
        Op::MkDir { parent: p, name, mode: 0o755 },
        Op::Unlink { parent: p, name },
        Op::RmDir { parent: p, name },
        Op::SymLink { parent: p, name, target: Path::new("/t") },
        Op::Rename { parent: p, name, new_parent: NodeId(9), new_name: OsStr::new("b"), flags: 1 },
        Op::Link { node: n, new_parent: NodeId(9), new_name: name },
        Op::Open { node: n, flags: libc::O_RDWR | libc::O_APPEND },
        Op::Create { parent: p, name, mode: 0o644, flags: libc::O_RDWR | libc::O_CREAT },
        Op::Read { node: n, fh, offset: 4096, size: 8192 },
        Op::Write { node: n, fh, offset: 1 << 40, data },
        Op::Flush { node: n, fh },
        Op::Fsync { node: n, fh, datasync: true },
        Op::Release { node: n, fh },
        Op::OpenDir { node: n },
        Op::ReadDir { node: n, fh, offset: 3, max_entries: 100, plus: true },
        Op::ReleaseDir { node: n, fh },
        Op::FsyncDir { node: n, fh, datasync: false },
        Op::StatFs { node: n },
        Op::Access { node: n, mask: 4 },
        Op::GetXattr { node: n, name: OsStr::new("user.x"), size: 0 },
        Op::SetXattr { node: n, name: OsStr::new("user.x"), value: data, flags: 1 },
        Op::ListXattr { node: n, size: 64 },
        Op::RemoveXattr { node: n, name: OsStr::new("user.x") },
        Op::Fallocate { node: n, fh, offset: 0, length: 4096, mode: 1 },
        Op::Lseek { node: n, fh, offset: -1, whence: 3 },
        Op::Ioctl { node: n, fh, cmd: 0x8008_6601, data, out_size: 8 },
        Op::Extended { node: n, name: "stats", args },
    ]
}

fn show(op: &Op) -> String {
    let args: Vec<String> = op.args().iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{} {:?} [{}]", op.name(), op.kind(), args.join(" "))
}

/// What each sample shows: itself, its node, and itself readdressed to node 99 (`at`) and to
/// node 98 with handle 77 (`on_open`).
const DESCRIBED: &[&str] = &[
    "lookup Lookup [parent=1 name=\"aé\"] | node=1 | at: lookup Lookup [parent=99 name=\"aé\"] | open: lookup Lookup [parent=98 name=\"aé\"]",
    "forget Forget [node=2 nlookup=3] | node=2 | at: forget Forget [node=99 nlookup=3] | open: forget Forget [node=98 nlookup=3]",
    "getattr GetAttr [node=2 fh=-1] | node=2 | at: getattr GetAttr [node=99 fh=-1] | open: getattr GetAttr [node=98 fh=77]",
    "getattr GetAttr [node=2 fh=5] | node=2 | at: getattr GetAttr [node=99 fh=-1] | open: getattr GetAttr [node=98 fh=77]",
    "setattr SetAttr [node=2 fh=5 mode=\"644\" gid=7 size=100 atime=true mtime=true] | node=2 | at: setattr SetAttr [node=99 fh=-1 mode=\"644\" gid=7 size=100 atime=true mtime=true] | open: setattr SetAttr [node=98 fh=77 mode=\"644\" gid=7 size=100 atime=true mtime=true]",
    "setattr SetAttr [node=2 fh=-1 uid=1] | node=2 | at: setattr SetAttr [node=99 fh=-1 uid=1] | open: setattr SetAttr [node=98 fh=77 uid=1]",
    "readlink ReadLink [node=2] | node=2 | at: readlink ReadLink [node=99] | open: readlink ReadLink [node=98]",
    "mknod MkNod [parent=1 name=\"aé\" mode=\"20644\" rdev=5] | node=1 | at: mknod MkNod [parent=99 name=\"aé\" mode=\"20644\" rdev=5] | open: mknod MkNod [parent=98 name=\"aé\" mode=\"20644\" rdev=5]",
    "mkdir MkDir [parent=1 name=\"aé\" mode=\"755\"] | node=1 | at: mkdir MkDir [parent=99 name=\"aé\" mode=\"755\"] | open: mkdir MkDir [parent=98 name=\"aé\" mode=\"755\"]",
    "unlink Unlink [parent=1 name=\"aé\"] | node=1 | at: unlink Unlink [parent=99 name=\"aé\"] | open: unlink Unlink [parent=98 name=\"aé\"]",
    "rmdir RmDir [parent=1 name=\"aé\"] | node=1 | at: rmdir RmDir [parent=99 name=\"aé\"] | open: rmdir RmDir [parent=98 name=\"aé\"]",
    "symlink SymLink [parent=1 name=\"aé\" target=\"/t\"] | node=1 | at: symlink SymLink [parent=99 name=\"aé\" target=\"/t\"] | open: symlink SymLink [parent=98 name=\"aé\" target=\"/t\"]",
    "rename Rename [parent=1 name=\"aé\" new_parent=9 new_name=\"b\" flags=1] | node=1 | at: rename Rename [parent=99 name=\"aé\" new_parent=9 new_name=\"b\" flags=1] | open: rename Rename [parent=98 name=\"aé\" new_parent=9 new_name=\"b\" flags=1]",
    "link Link [node=2 new_parent=9 new_name=\"aé\"] | node=2 | at: link Link [node=99 new_parent=9 new_name=\"aé\"] | open: link Link [node=98 new_parent=9 new_name=\"aé\"]",
    "open Open [node=2 flags=\"0o2002\"] | node=2 | at: open Open [node=99 flags=\"0o2002\"] | open: open Open [node=98 flags=\"0o2002\"]",
    "create Create [parent=1 name=\"aé\" mode=\"644\" flags=\"0o102\"] | node=1 | at: create Create [parent=99 name=\"aé\" mode=\"644\" flags=\"0o102\"] | open: create Create [parent=98 name=\"aé\" mode=\"644\" flags=\"0o102\"]",
    "read Read [node=2 fh=5 offset=4096 size=8192] | node=2 | at: read Read [node=99 fh=5 offset=4096 size=8192] | open: read Read [node=98 fh=77 offset=4096 size=8192]",
    "write Write [node=2 fh=5 offset=1099511627776 data=<3 bytes>] | node=2 | at: write Write [node=99 fh=5 offset=1099511627776 data=<3 bytes>] | open: write Write [node=98 fh=77 offset=1099511627776 data=<3 bytes>]",
    "flush Flush [node=2 fh=5] | node=2 | at: flush Flush [node=99 fh=5] | open: flush Flush [node=98 fh=77]",
    "fsync Fsync [node=2 fh=5 datasync=true] | node=2 | at: fsync Fsync [node=99 fh=5 datasync=true] | open: fsync Fsync [node=98 fh=77 datasync=true]",
    "release Release [node=2 fh=5] | node=2 | at: release Release [node=99 fh=5] | open: release Release [node=98 fh=77]",
    "opendir OpenDir [node=2] | node=2 | at: opendir OpenDir [node=99] | open: opendir OpenDir [node=98]",
    "readdir ReadDir [node=2 fh=5 offset=3 max_entries=100 plus=true] | node=2 | at: readdir ReadDir [node=99 fh=5 offset=3 max_entries=100 plus=true] | open: readdir ReadDir [node=98 fh=77 offset=3 max_entries=100 plus=true]",
    "releasedir ReleaseDir [node=2 fh=5] | node=2 | at: releasedir ReleaseDir [node=99 fh=5] | open: releasedir ReleaseDir [node=98 fh=77]",
    "fsyncdir FsyncDir [node=2 fh=5 datasync=false] | node=2 | at: fsyncdir FsyncDir [node=99 fh=5 datasync=false] | open: fsyncdir FsyncDir [node=98 fh=77 datasync=false]",
    "statfs StatFs [node=2] | node=2 | at: statfs StatFs [node=99] | open: statfs StatFs [node=98]",
    "access Access [node=2 mask=4] | node=2 | at: access Access [node=99 mask=4] | open: access Access [node=98 mask=4]",
    "getxattr GetXattr [node=2 name=\"user.x\" size=0] | node=2 | at: getxattr GetXattr [node=99 name=\"user.x\" size=0] | open: getxattr GetXattr [node=98 name=\"user.x\" size=0]",
    "setxattr SetXattr [node=2 name=\"user.x\" value=<3 bytes> flags=1] | node=2 | at: setxattr SetXattr [node=99 name=\"user.x\" value=<3 bytes> flags=1] | open: setxattr SetXattr [node=98 name=\"user.x\" value=<3 bytes> flags=1]",
    "listxattr ListXattr [node=2 size=64] | node=2 | at: listxattr ListXattr [node=99 size=64] | open: listxattr ListXattr [node=98 size=64]",
    "removexattr RemoveXattr [node=2 name=\"user.x\"] | node=2 | at: removexattr RemoveXattr [node=99 name=\"user.x\"] | open: removexattr RemoveXattr [node=98 name=\"user.x\"]",
    "fallocate Fallocate [node=2 fh=5 offset=0 length=4096 mode=1] | node=2 | at: fallocate Fallocate [node=99 fh=5 offset=0 length=4096 mode=1] | open: fallocate Fallocate [node=98 fh=77 offset=0 length=4096 mode=1]",
    "lseek Lseek [node=2 fh=5 offset=-1 whence=3] | node=2 | at: lseek Lseek [node=99 fh=5 offset=-1 whence=3] | open: lseek Lseek [node=98 fh=77 offset=-1 whence=3]",
    "ioctl Ioctl [node=2 fh=5 cmd=\"0x80086601\" data=<3 bytes> out_size=8] | node=2 | at: ioctl Ioctl [node=99 fh=5 cmd=\"0x80086601\" data=<3 bytes> out_size=8] | open: ioctl Ioctl [node=98 fh=77 cmd=\"0x80086601\" data=<3 bytes> out_size=8]",
    "stats Extended [node=2 op=\"stats\" args=[\"x\", \"y\"]] | node=2 | at: stats Extended [node=99 op=\"stats\" args=[\"x\", \"y\"]] | open: stats Extended [node=98 op=\"stats\" args=[\"x\", \"y\"]]",
];

#[test]
fn every_operation_describes_and_readdresses_itself() {
    let args = vec!["x".to_owned(), "y".to_owned()];
    let samples = samples(&args, b"abc");
    assert_eq!(samples.len(), DESCRIBED.len());
    for (op, want) in samples.iter().zip(DESCRIBED) {
        let got = format!(
            "{} | node={} | at: {} | open: {}",
            show(op),
            op.node().0,
            show(&op.at(NodeId(99))),
            show(&op.on_open(NodeId(98), FileHandle(77)))
        );
        assert_eq!(&got, want);
    }
    let kinds: std::collections::HashSet<OpKind> = samples.iter().map(|op| op.kind()).collect();
    assert_eq!(kinds.len(), OpKind::ALL.len(), "a sample of every operation");
}
