//! The bytes of every request on the wire, as protocol version 1 has them: the operations are
//! declared once in `plyfs-stack` and their header form derived from that declaration, so these
//! hold it to what peers already speak (`docs/protocol.md`). A change here is a new protocol
//! version, never an edit of these bytes.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use plyfs_stack::{from_unix_time, FileHandle, NodeId, Op, OpKind, SetAttr, TimeSet};
use plyfs_transport::wire::{self, CodecOp, Message, RequestOp, WireCaller};

const DATA: &[u8] = b"bulk";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn request(op: RequestOp) -> Message {
    Message::Req { id: 7, caller: WireCaller { uid: 1, gid: 2, pid: 3 }, op }
}

/// One of each operation (two of `getattr` and `setattr`: with and without their options).
fn samples() -> Vec<Op<'static>> {
    let (p, n, fh) = (NodeId(1), NodeId(2), FileHandle(5));
    let args: &'static [String] = Vec::leak(vec!["a".into(), "b".into()]);
    vec![
        Op::Lookup { parent: p, name: OsStr::new("a") },
        Op::Forget { node: n, nlookup: 3 },
        Op::GetAttr { node: n, fh: None },
        Op::GetAttr { node: n, fh: Some(fh) },
        Op::SetAttr {
            node: n,
            fh: Some(fh),
            set: SetAttr {
                mode: Some(0o644),
                uid: None,
                gid: Some(7),
                size: Some(100),
                atime: Some(TimeSet::Now),
                mtime: Some(TimeSet::At(from_unix_time(-5, 3))),
            },
        },
        Op::SetAttr { node: n, fh: None, set: SetAttr::default() },
        Op::ReadLink { node: n },
        Op::MkNod { parent: p, name: OsStr::new("n"), mode: 0o20644, rdev: 5 },
        Op::MkDir { parent: p, name: OsStr::new("d"), mode: 0o755 },
        Op::Unlink { parent: p, name: OsStr::new("u") },
        Op::RmDir { parent: p, name: OsStr::new("r") },
        Op::SymLink { parent: p, name: OsStr::new("s"), target: Path::new("/t") },
        Op::Rename { parent: p, name: OsStr::new("a"), new_parent: NodeId(9), new_name: OsStr::from_bytes(b"\xffb"), flags: 1 },
        Op::Link { node: n, new_parent: NodeId(9), new_name: OsStr::new("l") },
        Op::Open { node: n, flags: libc::O_RDWR },
        Op::Create { parent: p, name: OsStr::new("c"), mode: 0o644, flags: libc::O_RDWR | libc::O_CREAT },
        Op::Read { node: n, fh, offset: 4096, size: 8192 },
        Op::Write { node: n, fh, offset: 1 << 40, data: DATA },
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
        Op::SetXattr { node: n, name: OsStr::new("user.x"), value: DATA, flags: 1 },
        Op::ListXattr { node: n, size: 64 },
        Op::RemoveXattr { node: n, name: OsStr::new("user.x") },
        Op::Fallocate { node: n, fh, offset: 0, length: 4096, mode: 1 },
        Op::Lseek { node: n, fh, offset: -1, whence: 3 },
        Op::Ioctl { node: n, fh, cmd: 0x8008_6601, data: DATA, out_size: 8 },
        Op::Extended { node: n, name: "stats", args },
    ]
}

/// Their headers as version 1 encodes them, in the same order.
const STACK_BYTES: &[&str] = &[
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a66c6f6f6b7570a46172677382a6706172656e7401a46e616d65c40161",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a6666f72676574a46172677382a46e6f646502a76e6c6f6f6b757003",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a767657461747472a46172677382a46e6f646502a26668c0",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a767657461747472a46172677382a46e6f646502a2666805",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a773657461747472a46172677388a46e6f646502a2666805a46d6f6465cd01a4a3756964c0a367696407a473697a6564a56174696d65a36e6f77a56d74696d6581a2617492fb03",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a773657461747472a46172677388a46e6f646502a26668c0a46d6f6465c0a3756964c0a3676964c0a473697a65c0a56174696d65c0a56d74696d65c0",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a8726561646c696e6ba46172677381a46e6f646502",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a56d6b6e6f64a46172677384a6706172656e7401a46e616d65c4016ea46d6f6465cd21a4a47264657605",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a56d6b646972a46172677383a6706172656e7401a46e616d65c40164a46d6f6465cd01ed",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a6756e6c696e6ba46172677382a6706172656e7401a46e616d65c40175",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a5726d646972a46172677382a6706172656e7401a46e616d65c40172",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a773796d6c696e6ba46172677383a6706172656e7401a46e616d65c40173a6746172676574c4022f74",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a672656e616d65a46172677385a6706172656e7401a46e616d65c40161aa6e65775f706172656e7409a86e65775f6e616d65c402ff62a5666c61677301",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a46c696e6ba46172677383a46e6f646502aa6e65775f706172656e7409a86e65775f6e616d65c4016c",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a46f70656ea46172677382a46e6f646502a5666c61677302",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a6637265617465a46172677384a6706172656e7401a46e616d65c40163a46d6f6465cd01a4a5666c61677342",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a472656164a46172677384a46e6f646502a2666805a66f6666736574cd1000a473697a65cd2000",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a57772697465a46172677383a46e6f646502a2666805a66f6666736574cf0000010000000000",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a5666c757368a46172677382a46e6f646502a2666805",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a56673796e63a46172677383a46e6f646502a2666805a86461746173796e63c3",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a772656c65617365a46172677382a46e6f646502a2666805",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a76f70656e646972a46172677381a46e6f646502",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a772656164646972a46172677385a46e6f646502a2666805a66f666673657403ab6d61785f656e747269657364a4706c7573c3",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70aa72656c65617365646972a46172677382a46e6f646502a2666805",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a86673796e63646972a46172677383a46e6f646502a2666805a86461746173796e63c2",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a6737461746673a46172677381a46e6f646502",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a6616363657373a46172677382a46e6f646502a46d61736b04",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a86765747861747472a46172677383a46e6f646502a46e616d65c406757365722e78a473697a6500",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a87365747861747472a46172677383a46e6f646502a46e616d65c406757365722e78a5666c61677301",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a96c6973747861747472a46172677382a46e6f646502a473697a6540",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70ab72656d6f76657861747472a46172677382a46e6f646502a46e616d65c406757365722e78",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a966616c6c6f63617465a46172677385a46e6f646502a2666805a66f666673657400a66c656e677468cd1000a46d6f646501",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a56c7365656ba46172677384a46e6f646502a2666805a66f6666736574ffa67768656e636503",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a5696f63746ca46172677384a46e6f646502a2666805a3636d64ce80086601a86f75745f73697a6508",
    "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a8657874656e646564a46172677383a46e6f646502a46e616d65a57374617473a46172677392a161a162",
];

#[test]
fn every_operation_keeps_its_bytes_on_the_wire() {
    let samples = samples();
    assert_eq!(samples.len(), STACK_BYTES.len());
    for (op, want) in samples.iter().zip(STACK_BYTES) {
        let (header, payload) = op.to_header();
        assert_eq!(&hex(&wire::encode(&request(header.into()))), want, "{}", op.name());
        let takes_payload = matches!(op, Op::Write { .. } | Op::SetXattr { .. } | Op::Ioctl { .. });
        assert_eq!(payload, if takes_payload { DATA } else { &[] }, "{}", op.name());
    }
    let kinds: std::collections::HashSet<OpKind> = samples.iter().map(|op| op.kind()).collect();
    assert_eq!(kinds.len(), OpKind::ALL.len(), "a sample of every operation");
}

#[test]
fn every_operation_reads_back_from_its_bytes() {
    for (op, bytes) in samples().iter().zip(STACK_BYTES) {
        let bytes: Vec<u8> = (0..bytes.len()).step_by(2).map(|i| u8::from_str_radix(&bytes[i..i + 2], 16).unwrap()).collect();
        let Ok(Message::Req { op: RequestOp::Stack(header), .. }) = wire::decode(&bytes) else {
            panic!("{} does not decode as a stack operation", op.name())
        };
        let (_, payload) = op.to_header();
        let back = header.to_op(payload);
        assert_eq!(back.args(), op.args(), "{}", op.name());
        assert_eq!(back.to_header().0, header, "{}", op.name());
    }
}

#[test]
fn codec_requests_keep_their_bytes_on_the_wire() {
    let encode = request(CodecOp::Encode { chunk: 7 }.into());
    assert_eq!(hex(&wire::encode(&encode)), "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a6656e636f6465a46172677381a56368756e6b07");
    let decode = request(CodecOp::Decode { chunk: 7, decoded_len: 4096 }.into());
    assert_eq!(hex(&wire::encode(&decode)), "85a174a3726571a2696407a663616c6c657283a375696401a367696402a370696403a26f70a66465636f6465a46172677382a56368756e6b07ab6465636f6465645f6c656ecd1000");
    for msg in [encode, decode] {
        assert_eq!(wire::decode(&wire::encode(&msg)).unwrap(), msg);
    }
}
