//! The errors of this crate's own logic: what a codec reports, and what the index finds wrong
//! with itself. None of them knows the file: the framework, which does (`LowerIo::describe`),
//! names it and the operation when it turns one into a [`plyfs_stack::Error`] for the layer
//! interface, and when it logs one.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A codec could not encode a chunk; `why` in the codec's words.
    Encode { why: String },
    /// A codec could not decode a payload: it is damaged, or not this codec's (or key's).
    Decode { why: String },
    /// A decoder gave another number of bytes than the chunk holds.
    DecodedLength { got: usize, expected: usize },
    /// The index contradicts itself or the lower file: the first inconsistency found.
    Index { why: String },
    /// A checkpoint record (at `off` in the lower file) cannot be read back into an index.
    Checkpoint { off: u64, why: &'static str },
    /// A chunk of a synthesized file encoded to another length than its layout gives it.
    PayloadLength { chunk: u64, got: usize, expected: u64 },
}

impl Error {
    pub fn encode(why: impl fmt::Display) -> Error {
        Error::Encode { why: why.to_string() }
    }

    pub fn decode(why: impl fmt::Display) -> Error {
        Error::Decode { why: why.to_string() }
    }

    pub(crate) fn index(why: String) -> Error {
        Error::Index { why }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Encode { why } => write!(f, "encoding failed: {why}"),
            Error::Decode { why } => write!(f, "decoding failed: {why}"),
            Error::DecodedLength { got, expected } => write!(f, "decoded to {got} bytes, not {expected}"),
            Error::Index { why } => f.write_str(why),
            Error::Checkpoint { off, why } => write!(f, "checkpoint at {off}: {why}"),
            Error::PayloadLength { chunk, got, expected } => write!(f, "chunk {chunk} encoded to {got} bytes, not {expected}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn messages_say_what_was_being_done() {
        assert_eq!(Error::decode("authentication failed").to_string(), "decoding failed: authentication failed");
        assert_eq!(Error::encode("out of memory").to_string(), "encoding failed: out of memory");
        assert_eq!(Error::Checkpoint { off: 4096, why: "truncated" }.to_string(), "checkpoint at 4096: truncated");
        assert_eq!(Error::DecodedLength { got: 3, expected: 4 }.to_string(), "decoded to 3 bytes, not 4");
    }
}
