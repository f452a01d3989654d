//! The check of a peer's NIXL 1.5 metadata blob before it is handed to the library: a bounded
//! walk over its `nixlSerDes` fields.
//!
//! Separate because it is pure parsing of untrusted bytes (no library needed, tested on its
//! own), unlike the rest of the engine.

use super::EngineError;

/// A walk over a NIXL 1.5 metadata blob (`nixlSerDes`: after the `nixlSerDes|` header, each
/// field is its tag, a little-endian u64 length, that many bytes and a `|`).
struct MdReader<'a> {
    md: &'a [u8],
    at: usize,
}

impl<'a> MdReader<'a> {
    fn refuse(&self, reason: &'static str) -> EngineError {
        EngineError::NixlMetadata { reason, at: self.at, len: self.md.len() }
    }

    /// The value of the field at the cursor, which must carry `tag`.
    fn field(&mut self, tag: &str) -> Result<&'a [u8], EngineError> {
        let rest = &self.md[self.at..];
        let after_tag = rest
            .strip_prefix(tag.as_bytes())
            .ok_or_else(|| self.refuse("a field's tag is not the one due"))?;
        let (len, value) =
            after_tag.split_first_chunk::<8>().ok_or_else(|| self.refuse("cut short in a field's length"))?;
        let len = usize::try_from(u64::from_le_bytes(*len))
            .map_err(|_| self.refuse("a field's length is past usize"))?;
        if value.len() <= len {
            return Err(self.refuse("a field's value runs past the end"));
        }
        if value[len] != b'|' {
            return Err(self.refuse("a field does not end with '|'"));
        }
        self.at += tag.len() + 8 + len + 1;
        Ok(&value[..len])
    }

    /// A field holding a little-endian u64 count.
    fn count(&mut self, tag: &str) -> Result<u64, EngineError> {
        let v = self.field(tag)?;
        let v: [u8; 8] = v.try_into().map_err(|_| self.refuse("a count is not 8 bytes"))?;
        Ok(u64::from_le_bytes(v))
    }

    /// A field whose value must be non-empty (NIXL refuses empty names, types and lists).
    fn text(&mut self, tag: &str) -> Result<&'a [u8], EngineError> {
        let v = self.field(tag)?;
        if v.is_empty() {
            return Err(self.refuse("an empty name or value"));
        }
        Ok(v)
    }
}

/// Bytes of NIXL's `nixlBasicDesc` (address, length, device id).
const NIXL_BASIC_DESC_BYTES: usize = 24;

/// Check that `md` is one whole NIXL 1.5 metadata blob, field by field as NIXL 1.5's
/// `loadRemoteMD` reads it (header; `Agent`; `Conns` then that many backend `t`/`c` pairs;
/// `MemSection`; `nixlSecElms` sections of a `bknd` and a descriptor list `nixlDList` with its
/// `t` memory type, `n` descriptors and each descriptor), ending exactly at its end; returns
/// the agent name. A blob NIXL would refuse after it had loaded the peer's connection must
/// never reach it: NIXL 1.5.1 then drops its record of the connection without closing it, so
/// every later load of that peer, valid or not, is an invalid parameter and no call undoes it.
/// What remains for NIXL to refuse is a well-formed blob whose contents its backend cannot
/// use (a corrupt remote key); see docs/nixl.md.
pub fn check_metadata(md: &[u8]) -> Result<&str, EngineError> {
    const HEADER: &[u8] = b"nixlSerDes|";
    let mut r = MdReader { md, at: 0 };
    if !md.starts_with(HEADER) {
        return Err(r.refuse("no nixlSerDes header"));
    }
    r.at = HEADER.len();
    let name = std::str::from_utf8(r.text("Agent")?).map_err(|_| r.refuse("the agent name is not UTF-8"))?;
    for _ in 0..r.count("Conns")? {
        r.text("t")?;
        r.text("c")?;
    }
    if r.field("")? != b"MemSection" {
        return Err(r.refuse("no MemSection after the connections"));
    }
    for _ in 0..r.count("nixlSecElms")? {
        r.text("bknd")?;
        let list = r.text("nixlDList")?;
        if r.field("t")?.len() != 4 {
            return Err(r.refuse("a memory type is not 4 bytes"));
        }
        let n = r.count("n")?;
        if n == 0 {
            return Err(r.refuse("an empty descriptor list"));
        }
        match list {
            b"nixlSDList" => {
                for _ in 0..n {
                    if r.field("")?.len() < NIXL_BASIC_DESC_BYTES {
                        return Err(r.refuse("a descriptor shorter than its address, length and device"));
                    }
                }
            }
            b"nixlBDList" => {
                let want = usize::try_from(n).ok().and_then(|n| n.checked_mul(NIXL_BASIC_DESC_BYTES));
                if Some(r.field("")?.len()) != want {
                    return Err(r.refuse("a basic descriptor list of the wrong length"));
                }
            }
            _ => return Err(r.refuse("an unknown descriptor list type")),
        }
    }
    if r.at != md.len() {
        return Err(r.refuse("bytes after the last section"));
    }
    Ok(name)
}
