//! The decoder against arbitrary, truncated and mutated input: it answers with an error, never a
//! panic, and never reserves memory beyond the protocol's limits.

use plyfs_transport::wire::{self, limits, Message, OpHeader, Payload, SetAttrHeader, WireCaller, WireReply};
use proptest::prelude::*;

fn samples() -> Vec<Vec<u8>> {
    let caller = WireCaller { uid: 1, gid: 2, pid: 3 };
    let b = |s: &[u8]| serde_bytes::ByteBuf::from(s.to_vec());
    let msgs = [
        Message::Hello { versions: vec![1], software: "x".into(), auth: Some(b(&[1; 32])) },
        Message::Req { id: 1, caller, op: OpHeader::Lookup { parent: 1, name: b(b"name") }.into() },
        Message::Req { id: 2, caller, op: OpHeader::Write { node: 5, fh: 3, offset: 1 << 40, data: Payload }.into() },
        Message::Req { id: 3, caller, op: OpHeader::Rename { parent: 1, name: b(b"a"), new_parent: 2, new_name: b(b"b"), flags: 1 }.into() },
        Message::Req { id: 4, caller, op: OpHeader::Extended { node: 1, name: "stats".into(), args: vec!["a".into(), "b".into()] }.into() },
        Message::Req {
            id: 5,
            caller,
            op: OpHeader::SetAttr {
                node: 1,
                fh: Some(2),
                set: SetAttrHeader { mode: Some(0o644), uid: None, gid: Some(3), size: Some(9), atime: None, mtime: None },
            }
            .into(),
        },
        Message::Rep { id: 6, reply: WireReply::Extended(serde_json::json!({"k": [1, 2, {"z": null}]})) },
        Message::Changed { changes: vec![wire::Change::Entry { parent: 1, name: b(b"x") }, wire::Change::Node { node: 9 }] },
    ];
    msgs.iter().map(wire::encode).collect()
}

/// Decode as a server would: the header, then the operation with a payload.
fn exercise(header: &[u8], payload: &[u8]) {
    if let Ok(Message::Req { op, .. }) = wire::decode(header) {
        let _ = op.stack_op(payload);
    }
    let _ = rmp_serde::from_slice::<wire::JustId>(header);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        exercise(&bytes, &[]);
        let _ = wire::read_frame(&mut &bytes[..]);
    }

    #[test]
    fn mutated_messages_never_panic(which in 0usize..8, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut m = samples()[which].clone();
        for (at, v) in flips {
            let at = at % m.len();
            m[at] = v;
        }
        exercise(&m, b"payload");
        let cut = cut % (m.len() + 1);
        exercise(&m[..cut], &[]);
    }

    #[test]
    fn frame_lengths_over_the_limits_are_refused(header in any::<u32>(), payload in any::<u32>()) {
        let mut frame = header.to_be_bytes().to_vec();
        frame.extend_from_slice(&payload.to_be_bytes());
        match wire::read_frame(&mut &frame[..]) {
            Err(wire::FrameError::TooLarge { .. }) => {
                prop_assert!(header == 0 || header as usize > limits::MAX_HEADER || payload as usize > limits::MAX_PAYLOAD)
            }
            // Within the limits, the frame is merely truncated.
            Err(_) => prop_assert!(header as usize <= limits::MAX_HEADER && payload as usize <= limits::MAX_PAYLOAD),
            Ok(_) => prop_assert!(header == 0 && payload == 0),
        }
    }
}
