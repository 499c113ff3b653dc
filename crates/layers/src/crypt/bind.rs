//! Binding a file's content to its place (`plyfs init --bind-paths`): what keeps a file that was
//! moved or swapped in the storage from reading as the file whose place it took.
//!
//! Every chunk is already sealed with the file id of its file header (see [`super::codec`]), so
//! a file's content cannot be mixed with another's; but a whole lower file can be renamed over
//! another, and then reads as that one (gocryptfs has the same limit). With binding, each file
//! carries a *place tag*:
//!
//! ```text
//! place tag  = HMAC-SHA256(bind key, "plyfs bind place" || file id (16) || directory id (16) || lower name)
//! linked tag = HMAC-SHA256(bind key, "plyfs bind linked" || file id (16))
//! stored     = kind (1: placed, 2: linked) [ || current tag (32) [ || previous tag (32) ] ]
//!              in the lower xattr user.plyfs.bind
//! ```
//!
//! The bind key is HKDF of the master key (purpose "bind paths hmac-sha256"). The tag covers the
//! file id, which authenticates every chunk, so neither the content nor the tag can be moved
//! without the other, and a tag cannot be made without the key. `crypt-names` checks it at every
//! open of a file that has a header; a file whose tag does not fit its place is `EIO`.
//!
//! - **Rename** writes the tag of the new place *before* the lower rename, keeping the old one
//!   as the previous tag: a crash at any point leaves the file valid where it is (the previous
//!   tag is dropped at the next rename). A directory's rename changes nothing below it: its
//!   children are bound to its id, which moves with it.
//! - **Hard links**: a file given a second name through the mount gets the linked tag, which
//!   binds it to its file id only, from then on: it has no single place. The kind byte keeps
//!   that when the file has no header yet, and when its content is written anew (a new file id)
//!   under a name the mount may not have seen last.
//! - **Files without a header** (empty, never written) have no file id and nothing to bind.
//!
//! The tag is not in the file header: the header belongs to the size-changing layer above,
//! which knows nothing of places, and a rename must not rewrite content.

use plyfs_sca::format::{FileHeader, FILE_MAGIC};
use super::keys::MasterKey;

/// The lower extended attribute holding a file's tags.
pub const BIND_XATTR: &str = "user.plyfs.bind";
pub const TAG_BYTES: usize = 32;
/// The longest value of [`BIND_XATTR`]: the kind and two tags.
pub const STORED_MAX_BYTES: usize = 1 + 2 * TAG_BYTES;
/// Bytes of a lower file that hold its file id.
pub const HEAD_BYTES: usize = 40;

pub type Tag = [u8; TAG_BYTES];

/// The key of a volume's place tags.
pub struct BindKey(ring::hmac::Key);

impl BindKey {
    pub fn of(key: &MasterKey) -> BindKey {
        BindKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key.subkey::<32>("bind paths hmac-sha256")[..]))
    }

    fn mac(&self, parts: &[&[u8]]) -> Tag {
        let mut m = ring::hmac::Context::with_key(&self.0);
        for p in parts {
            m.update(p);
        }
        m.sign().as_ref().try_into().expect("32-byte HMAC-SHA256")
    }

    /// The tag of file `file_id` named `lower_name` in the directory whose id is `dir_id`.
    pub fn place_tag(&self, file_id: &[u8; 16], dir_id: &[u8; 16], lower_name: &[u8]) -> Tag {
        self.mac(&[b"plyfs bind place", file_id, dir_id, lower_name])
    }

    /// The tag of file `file_id` wherever it is (a file with several names).
    pub fn linked_tag(&self, file_id: &[u8; 16]) -> Tag {
        self.mac(&[b"plyfs bind linked", file_id])
    }
}

/// What the first bytes of a lower file say about its identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// No header (an empty file, or not one of the size-changing framework's): nothing to bind.
    None,
    /// A header whose file id is damaged: the content layer refuses it on its own.
    Damaged,
    Id([u8; 16]),
}

impl Head {
    pub fn of(bytes: &[u8]) -> Head {
        if bytes.len() < HEAD_BYTES || bytes[..8] != FILE_MAGIC {
            return Head::None;
        }
        match FileHeader::decode(bytes).and_then(|h| h.file_id) {
            Some(id) => Head::Id(id),
            None => Head::Damaged,
        }
    }
}

/// The tags stored for a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The file was hard-linked through the mount: it is bound to its file id only, for good.
    pub linked: bool,
    /// None: a linked file with no header yet.
    pub current: Option<Tag>,
    pub previous: Option<Tag>,
}

const KIND_PLACED: u8 = 1;
const KIND_LINKED: u8 = 2;

impl Stored {
    pub fn placed(current: Tag, previous: Option<Tag>) -> Stored {
        Stored { linked: false, current: Some(current), previous }
    }

    pub fn linked(current: Option<Tag>) -> Stored {
        Stored { linked: true, current, previous: None }
    }

    /// What a damaged value stands for: tags that match no place.
    pub fn damaged() -> Stored {
        Stored::placed([0; TAG_BYTES], None)
    }

    pub fn decode(bytes: &[u8]) -> Option<Stored> {
        let (&kind, tags) = bytes.split_first()?;
        let linked = match kind {
            KIND_PLACED => false,
            KIND_LINKED => true,
            _ => return None,
        };
        let tag = |i: usize| -> Option<Tag> { tags[i * TAG_BYTES..(i + 1) * TAG_BYTES].try_into().ok() };
        let (current, previous) = match tags.len() {
            0 if linked => (None, None),
            TAG_BYTES => (tag(0), None),
            n if n == 2 * TAG_BYTES && !linked => (tag(0), tag(1)),
            _ => return None,
        };
        Some(Stored { linked, current, previous })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![if self.linked { KIND_LINKED } else { KIND_PLACED }];
        for t in self.current.iter().chain(&self.previous) {
            v.extend_from_slice(t);
        }
        v
    }
}

/// Whether a file with id `file_id`, whose tags are `stored`, may be read at the place whose
/// tag is `here`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Bound to this place (by its current tag, or by the previous one: a rename that was cut
    /// short, or whose tag this mount has not seen yet).
    Here,
    /// Bound to its file id only (it was hard-linked).
    Linked,
    /// No tag at all: taken off, or never written (a crash right after the header was).
    Missing,
    /// Bound to another place: moved or swapped below, or not this volume's.
    Elsewhere,
}

pub fn verdict(key: &BindKey, stored: Option<&Stored>, file_id: &[u8; 16], here: &Tag) -> Verdict {
    let Some(s @ Stored { current: Some(current), .. }) = stored else { return Verdict::Missing };
    if current == here || s.previous.as_ref() == Some(here) {
        Verdict::Here
    } else if *current == key.linked_tag(file_id) {
        Verdict::Linked
    } else {
        Verdict::Elsewhere
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> BindKey {
        BindKey::of(&MasterKey::from_bytes([b; 32]))
    }

    #[test]
    fn a_tag_holds_only_at_its_place_for_its_file() {
        let k = key(1);
        let (f1, f2, d1, d2) = ([1; 16], [2; 16], [3; 16], [4; 16]);
        let here = k.place_tag(&f1, &d1, b"a");
        let stored = Stored::placed(here, None);
        assert_eq!(verdict(&k, Some(&stored), &f1, &here), Verdict::Here);
        // Another name, another directory, another file, another key: elsewhere.
        for other in [k.place_tag(&f1, &d1, b"b"), k.place_tag(&f1, &d2, b"a"), k.place_tag(&f2, &d1, b"a"), key(2).place_tag(&f1, &d1, b"a")] {
            assert_eq!(verdict(&k, Some(&stored), &f1, &other), Verdict::Elsewhere);
        }
        assert_eq!(verdict(&k, None, &f1, &here), Verdict::Missing);
        // The name and the directory id are not confused at their seam.
        assert_ne!(k.place_tag(&f1, &d1, b"ab"), k.place_tag(&f1, &d1, b"a"));
    }

    #[test]
    fn a_rename_keeps_both_places_and_a_linked_file_is_anywhere() {
        let k = key(1);
        let (old, new) = (k.place_tag(&[1; 16], &[3; 16], b"a"), k.place_tag(&[1; 16], &[3; 16], b"b"));
        let s = Stored::placed(new, Some(old));
        assert_eq!(Stored::decode(&s.encode()), Some(s));
        assert_eq!(verdict(&k, Some(&s), &[1; 16], &old), Verdict::Here);
        assert_eq!(verdict(&k, Some(&s), &[1; 16], &new), Verdict::Here);
        let linked = Stored::linked(Some(k.linked_tag(&[1; 16])));
        assert_eq!(Stored::decode(&linked.encode()), Some(linked));
        assert_eq!(verdict(&k, Some(&linked), &[1; 16], &old), Verdict::Linked);
        // A linked tag is its own file's only.
        assert_eq!(verdict(&k, Some(&linked), &[2; 16], &k.place_tag(&[2; 16], &[3; 16], b"a")), Verdict::Elsewhere);
        // A linked file without a header yet has no tag: once it has a header, that is missing.
        let marker = Stored::linked(None);
        assert_eq!(Stored::decode(&marker.encode()), Some(marker));
        assert_eq!(verdict(&k, Some(&marker), &[1; 16], &old), Verdict::Missing);
        for bad in [&[][..], &[0; 33], &[1; 31], &[1][..], &[3; 33]] {
            assert_eq!(Stored::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_head_gives_the_file_id_or_says_there_is_none() {
        let h = FileHeader { codec: *b"cgcm", chunk_shift: 12, file_id: Some([7; 16]), flags: 0 };
        assert_eq!(Head::of(&h.encode()), Head::Id([7; 16]));
        assert_eq!(Head::of(&[]), Head::None);
        assert_eq!(Head::of(b"hello, world, this is not a header at all"), Head::None);
        let mut damaged = h.encode();
        damaged[25] ^= 1;
        assert_eq!(Head::of(&damaged), Head::Damaged);
    }
}
