//! The exodisk service's request decoder, fed whatever libFuzzer makes, as a whole message and
//! as a first message (within the hello's limit). It must answer or refuse, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use plyfs_exodisk::proto;

fuzz_target!(|data: &[u8]| {
    let _ = proto::decode_message(data);
    let _ = proto::read_message_within(&mut &data[..], proto::MAX_HELLO);
});
