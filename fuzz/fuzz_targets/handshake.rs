//! The server's handshake, fed whatever libFuzzer makes: the first byte chooses whether the
//! preamble goes first, the rest is what the client sends. The server must end the connection
//! without panicking, and never welcome a client without the proof.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use plyfs_transport::server::{Authenticator, Identity, Server, ServerOptions};
use plyfs_transport::wire::{self, Message};

const PROOF: [u8; 32] = [0x5a; 32];

struct Key;

impl Authenticator for Key {
    fn check(&self, proof: Option<&[u8]>) -> Result<Option<Vec<u8>>, String> {
        match proof {
            Some(p) if p == PROOF => Ok(Some(vec![1; 32])),
            _ => Err("wrong key".into()),
        }
    }
}

fn server() -> &'static Arc<Server> {
    static SERVER: OnceLock<Arc<Server>> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("plyfs-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lower = Arc::new(plyfs_stack::LowerDir::open(&dir).unwrap());
        let stack = plyfs_stack::Stack::build(&[], &[], lower).unwrap();
        let options = ServerOptions { handshake_timeout: Duration::from_millis(500), ..Default::default() };
        Server::for_stack(&stack, options)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    let mut input = if first & 1 == 1 { wire::PREAMBLE.to_vec() } else { Vec::new() };
    input.extend_from_slice(rest);
    let (ours, theirs) = UnixStream::pair().unwrap();
    let server = server().clone();
    let serving = std::thread::spawn(move || server.serve(Box::new(theirs), "fuzz", Identity::AsSent, Some(&Key)));
    let _ = (&ours).write_all(&input);
    let _ = ours.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    let _ = (&ours).read_to_end(&mut answer);
    serving.join().unwrap();
    if let Some(frame) = answer.strip_prefix(&wire::PREAMBLE).and_then(|a| wire::read_frame(&mut &a[..]).ok()) {
        if let Ok(Message::Welcome { .. }) = wire::decode(&frame.header) {
            let hello = wire::read_frame(&mut &input[8..]).expect("a welcome answers a whole frame");
            assert!(
                matches!(wire::decode(&hello.header), Ok(Message::Hello { auth: Some(a), .. }) if a[..] == PROOF),
                "welcome without the proof"
            );
        }
    }
});
