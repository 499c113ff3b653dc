//! The machinery that turns the one list of operations (in `op/mod.rs`) into everything that
//! names every operation: [`Op`](super::Op), [`OpKind`](super::OpKind), the descriptor
//! (`Op::args`), readdressing, and the owned form a request carries,
//! [`OpHeader`](super::OpHeader), with its conversions both ways.
//!
//! Each field of an operation is declared with an argument *kind*, one word from a small
//! vocabulary, which gives its type in `Op<'a>` ([`arg_type!`]) and in `OpHeader`
//! ([`header_type!`]); what a kind does (describe itself, travel, follow a new handle) is the
//! [`OpArg`](super::header::OpArg) trait on its `Op` type.

/// The type an argument kind has in `Op<'a>`.
macro_rules! arg_type {
    (Node) => { NodeId };
    (Handle) => { FileHandle };
    (MaybeHandle) => { Option<FileHandle> };
    (Name) => { &'a OsStr };
    (Path) => { &'a Path };
    (Str) => { &'a str };
    (Strs) => { &'a [String] };
    (Payload) => { &'a [u8] };
    (SetAttr) => { SetAttr };
    ($plain:ident) => { $plain };
}

/// The type an argument kind has in `OpHeader`: numbers for ids and handles, bytes for names.
macro_rules! header_type {
    (Node) => { u64 };
    (Handle) => { u64 };
    (MaybeHandle) => { Option<u64> };
    (Name) => { ByteBuf };
    (Path) => { ByteBuf };
    (Str) => { String };
    (Strs) => { Vec<String> };
    (Payload) => { Payload };
    (SetAttr) => { SetAttrHeader };
    ($plain:ident) => { $plain };
}

/// Whether an argument kind travels as the request's payload.
macro_rules! in_payload {
    (Payload) => { true };
    ($other:ident) => { false };
}

/// Push a field's descriptor entry: by its kind, or as the declaration says it is shown.
macro_rules! describe_arg {
    ($args:ident, $field:ident) => { OpArg::describe($field, stringify!($field), &mut $args) };
    ($args:ident, $field:ident as octal) => { $args.push((stringify!($field), Arg::Str(format!("{:o}", $field).into()))) };
    ($args:ident, $field:ident as open_flags) => { $args.push((stringify!($field), Arg::Str(format!("{:#o}", $field).into()))) };
    ($args:ident, $field:ident as hex) => { $args.push((stringify!($field), Arg::Str(format!("{:#x}", $field).into()))) };
    ($args:ident, $field:ident as $key:literal) => { OpArg::describe($field, $key, &mut $args) };
}

/// Declare the operations. Each is `Variant "name" { node_field: Node, field: Kind, ... }`:
/// the first field is the node the operation addresses; a field may be followed by
/// `as octal`, `as open_flags`, `as hex` (how its descriptor shows it) or `as "key"` (the name
/// its descriptor gives it), and preceded by `#[serde(...)]` attributes for its header form.
macro_rules! declare_operations {
    ($(
        $(#[$doc:meta])*
        $op:ident $name:literal {
            $first:ident : Node
            $(, $(#[$header_attr:meta])* $field:ident : $kind:ident $(as $shown:tt)?)* $(,)?
        }
    ),* $(,)?) => {
        /// One file-system operation with its arguments.
        ///
        /// Operations on open files carry the node as well as the handle, so a layer that keeps
        /// per-node state need not map handles back to nodes.
        #[derive(Clone, Copy, Debug)]
        pub enum Op<'a> {
            $( $(#[$doc])* $op { $first: NodeId $(, $field: arg_type!($kind))* }, )*
        }

        /// The kind of an [`Op`], without its arguments: a small index for per-operation tables.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum OpKind { $($op),* }

        impl OpKind {
            pub const ALL: &'static [OpKind] = &[$(OpKind::$op),*];

            /// The operation's name as it appears in logs, statistics and on the wire.
            pub fn name(self) -> &'static str {
                match self { $(OpKind::$op => $name),* }
            }
        }

        /// An [`Op`] in owned, serialisable form, as the header of a request carries it (see
        /// `docs/protocol.md`): named by [`OpKind::name`], with its arguments by name, node ids
        /// and handles as numbers and names as bytes. Its bulk data (`write`, `setxattr`,
        /// `ioctl`) is not in it ([`op_header::Payload`](crate::op_header::Payload)): it travels
        /// beside it as the frame's payload, so it is never copied through the serialiser.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "op", content = "args")]
        pub enum OpHeader {
            $(
                #[serde(rename = $name)]
                $op { $first: u64 $(, $(#[$header_attr])* $field: header_type!($kind))* },
            )*
        }

        impl<'a> Op<'a> {
            pub fn kind(&self) -> OpKind {
                match self { $(Op::$op { .. } => OpKind::$op),* }
            }

            /// The node the operation addresses (the parent directory for name operations).
            pub fn node(&self) -> NodeId {
                match *self { $(Op::$op { $first, .. } => $first),* }
            }

            /// The same operation addressed to `to`; handles become `handle` where it is given,
            /// and optional handles become `handle` always.
            fn readdressed(&self, to: NodeId, handle: Option<FileHandle>) -> Op<'a> {
                match *self {
                    $(Op::$op { $($field,)* .. } => Op::$op { $first: to $(, $field: OpArg::readdressed($field, handle))* },)*
                }
            }

            /// The operation's typed arguments, in order, with their names: its descriptor.
            pub fn args(&self) -> Vec<(&'static str, Arg<'_>)> {
                match *self {
                    $(Op::$op { $first $(, $field)* } => {
                        #[allow(unused_mut)] // operations with only a node push nothing more
                        let mut args = vec![(stringify!($first), Arg::U64($first.0))];
                        $(describe_arg!(args, $field $(as $shown)?);)*
                        args
                    })*
                }
            }

            /// The owned form of the operation, and its payload.
            pub fn to_header(&self) -> (OpHeader, &'a [u8]) {
                let mut payload: &'a [u8] = &[];
                let header = match *self {
                    $(Op::$op { $first $(, $field)* } => OpHeader::$op {
                        $first: $first.0 $(, $field: OpArg::to_header($field, &mut payload))*
                    },)*
                };
                (header, payload)
            }
        }

        impl OpHeader {
            pub fn kind(&self) -> OpKind {
                match self { $(OpHeader::$op { .. } => OpKind::$op),* }
            }

            /// The node the operation addresses, as a number.
            pub fn node(&self) -> u64 {
                match *self { $(OpHeader::$op { $first, .. } => $first),* }
            }

            /// Whether the operation carries a payload (and so may be sent one).
            pub fn takes_payload(&self) -> bool {
                match self { $(OpHeader::$op { .. } => false $(|| in_payload!($kind))*),* }
            }

            /// The operation, borrowing its names from the header and its bulk data from
            /// `payload`. Nothing is checked here: a server checks the result against its limits
            /// before any layer sees it.
            pub fn to_op<'a>(&'a self, payload: &'a [u8]) -> Op<'a> {
                match self {
                    $(OpHeader::$op { $first $(, $field)* } => Op::$op {
                        $first: NodeId(*$first) $(, $field: OpArg::from_header($field, payload))*
                    },)*
                }
            }
        }
    };
}
