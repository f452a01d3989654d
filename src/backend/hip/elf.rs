//! Just enough ELF64 and clang-offload-bundle reading to list the symbols of an AMDGPU code
//! object, so a test (and a user on a machine without a GPU) can check that an embedded
//! object holds every kernel the HIP backend looks up, and for which GPU it was built.
//!
//! Every offset and length read from the bytes is checked: a truncated or hostile file is an
//! [`ElfError`], never a panic or an out-of-bounds read.

use thiserror::Error;

/// `e_machine` of an AMDGPU code object.
pub const EM_AMDGPU: u16 = 224;
/// `e_flags & EF_AMDGPU_MACH` is the processor a code object was built for.
pub const EF_AMDGPU_MACH: u32 = 0x0ff;
/// `EF_AMDGPU_MACH` values of the processors build.rs targets (LLVM's `ELF.h`).
pub const EF_AMDGPU_MACH_GFX90A: u32 = 0x03f;
/// `EF_AMDGPU_MACH` of gfx942 (MI300).
pub const EF_AMDGPU_MACH_GFX942: u32 = 0x04c;

const SHT_SYMTAB: u32 = 2;
const SHT_DYNSYM: u32 = 11;
const SHN_UNDEF: u16 = 0;
const SYM_ENTRY_BYTES: u64 = 24;
const SECTION_HEADER_BYTES: u64 = 64;
const BUNDLE_MAGIC: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";

/// The ELF symbol types a kernel shows up as.
pub const STT_OBJECT: u8 = 1;
/// A function symbol (how code-object v3+ kernels appear).
pub const STT_FUNC: u8 = 2;
/// Code-object v2's kernel type; later versions use `STT_FUNC`.
pub const STT_AMDGPU_HSA_KERNEL: u8 = 10;

crate::variant::variant_names! {
/// What reading a code object can fail with.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ElfError {
    /// Not an ELF file.
    #[error("not an ELF file (first bytes {magic:02x?})")]
    NotElf {
        /// The file's first bytes.
        magic: Vec<u8>,
    },
    /// Not ELF64 little-endian.
    #[error("ELF class {class} / data encoding {data}: only ELF64 little-endian is read")]
    Unsupported {
        /// `EI_CLASS`.
        class: u8,
        /// `EI_DATA`.
        data: u8,
    },
    /// A structure runs past the end of the file.
    #[error("{what} at byte {offset} (+{len}) runs past the end of the {size}-byte file")]
    Truncated {
        /// The structure being read.
        what: &'static str,
        /// Its offset in the file.
        offset: u64,
        /// Its length.
        len: u64,
        /// The file's length.
        size: u64,
    },
    /// Section headers of an unexpected size.
    #[error("section header entry size {got}, expected 64")]
    SectionEntrySize {
        /// `e_shentsize` as found.
        got: u16,
    },
    /// Symbol entries of an unexpected size.
    #[error("symbol entry size {got}, expected 24")]
    SymbolEntrySize {
        /// `sh_entsize` as found.
        got: u64,
    },
    /// A symbol table's string table index out of range.
    #[error("symbol table's string table index {link} is not one of the {count} sections")]
    BadLink {
        /// `sh_link` as found.
        link: u32,
        /// Sections in the file.
        count: u16,
    },
    /// A symbol name that is not NUL-terminated UTF-8.
    #[error("symbol name at string offset {offset} is not NUL-terminated UTF-8")]
    BadName {
        /// Offset of the name in the string table.
        offset: u64,
    },
    /// A compressed offload bundle (not read here).
    #[error("compressed offload bundle: decompress it with clang-offload-bundler first")]
    CompressedBundle,
}
}

/// One entry of `.symtab` or `.dynsym`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElfSymbol {
    /// The symbol's name.
    pub name: String,
    /// `STT_*` (low nibble of `st_info`).
    pub kind: u8,
    /// Not `SHN_UNDEF`: the object itself defines it.
    pub defined: bool,
    /// `st_size`.
    pub size: u64,
}

/// The parts of an ELF64 file this crate looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElfObject {
    /// `e_machine` ([`EM_AMDGPU`] for a code object).
    pub machine: u16,
    /// `e_flags` (the processor is `flags & EF_AMDGPU_MACH`).
    pub flags: u32,
    /// `.symtab` and `.dynsym` together (a name may appear in both).
    pub symbols: Vec<ElfSymbol>,
}

impl ElfObject {
    /// `EF_AMDGPU_MACH` of an AMDGPU object.
    pub fn amdgpu_mach(&self) -> u32 {
        self.flags & EF_AMDGPU_MACH
    }

    /// An AMDGPU kernel is a defined function symbol plus its kernel descriptor
    /// `<name>.kd`, which is what the ROCm loader (and so `hipModuleGetFunction`) looks up.
    pub fn has_kernel(&self, name: &str) -> bool {
        let descriptor = format!("{name}.kd");
        let has_function = self
            .symbols
            .iter()
            .any(|s| s.defined && s.name == name && (s.kind == STT_FUNC || s.kind == STT_AMDGPU_HSA_KERNEL));
        let has_descriptor =
            self.symbols.iter().any(|s| s.defined && s.name == descriptor && s.kind == STT_OBJECT);
        has_function && has_descriptor
    }
}

fn slice<'a>(bytes: &'a [u8], offset: u64, len: u64, what: &'static str) -> Result<&'a [u8], ElfError> {
    let size = bytes.len() as u64;
    let truncated = ElfError::Truncated { what, offset, len, size };
    let end = offset.checked_add(len).ok_or(truncated.clone())?;
    if end > size {
        return Err(truncated);
    }
    // Both bounds are <= bytes.len(), which is a usize.
    Ok(&bytes[offset as usize..end as usize])
}

fn u16_at(bytes: &[u8], offset: u64, what: &'static str) -> Result<u16, ElfError> {
    let b = slice(bytes, offset, 2, what)?;
    Ok(u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(bytes: &[u8], offset: u64, what: &'static str) -> Result<u32, ElfError> {
    let b = slice(bytes, offset, 4, what)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn u64_at(bytes: &[u8], offset: u64, what: &'static str) -> Result<u64, ElfError> {
    let b = slice(bytes, offset, 8, what)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Ok(u64::from_le_bytes(a))
}

struct Section {
    kind: u32,
    offset: u64,
    size: u64,
    link: u32,
    entsize: u64,
}

fn section(bytes: &[u8], shoff: u64, index: u64) -> Result<Section, ElfError> {
    let base = index.checked_mul(SECTION_HEADER_BYTES).and_then(|o| o.checked_add(shoff)).ok_or(
        ElfError::Truncated {
            what: "section header",
            offset: shoff,
            len: u64::MAX,
            size: bytes.len() as u64,
        },
    )?;
    slice(bytes, base, SECTION_HEADER_BYTES, "section header")?;
    Ok(Section {
        kind: u32_at(bytes, base + 4, "sh_type")?,
        offset: u64_at(bytes, base + 24, "sh_offset")?,
        size: u64_at(bytes, base + 32, "sh_size")?,
        link: u32_at(bytes, base + 40, "sh_link")?,
        entsize: u64_at(bytes, base + 56, "sh_entsize")?,
    })
}

fn name_at(strtab: &[u8], offset: u64) -> Result<String, ElfError> {
    let bad = ElfError::BadName { offset };
    let start = usize::try_from(offset).map_err(|_| bad.clone())?;
    let rest = strtab.get(start..).ok_or(bad.clone())?;
    let len = rest.iter().position(|&b| b == 0).ok_or(bad.clone())?;
    std::str::from_utf8(&rest[..len]).map(str::to_owned).map_err(|_| bad)
}

/// Read the header and both symbol tables of an ELF64 little-endian file.
pub fn parse(bytes: &[u8]) -> Result<ElfObject, ElfError> {
    let ident = slice(bytes, 0, 16, "ELF identification")
        .map_err(|_| ElfError::NotElf { magic: bytes.iter().take(4).copied().collect() })?;
    if &ident[..4] != b"\x7fELF" {
        return Err(ElfError::NotElf { magic: ident[..4].to_vec() });
    }
    let (class, data) = (ident[4], ident[5]);
    if class != 2 || data != 1 {
        return Err(ElfError::Unsupported { class, data });
    }
    let machine = u16_at(bytes, 0x12, "e_machine")?;
    let flags = u32_at(bytes, 0x30, "e_flags")?;
    let shoff = u64_at(bytes, 0x28, "e_shoff")?;
    let shentsize = u16_at(bytes, 0x3a, "e_shentsize")?;
    let shnum = u16_at(bytes, 0x3c, "e_shnum")?;
    if shnum > 0 && u64::from(shentsize) != SECTION_HEADER_BYTES {
        return Err(ElfError::SectionEntrySize { got: shentsize });
    }

    let mut symbols = Vec::new();
    for index in 0..u64::from(shnum) {
        let table = section(bytes, shoff, index)?;
        if table.kind != SHT_SYMTAB && table.kind != SHT_DYNSYM {
            continue;
        }
        if table.entsize != SYM_ENTRY_BYTES {
            return Err(ElfError::SymbolEntrySize { got: table.entsize });
        }
        if table.link >= u32::from(shnum) {
            return Err(ElfError::BadLink { link: table.link, count: shnum });
        }
        let strings = section(bytes, shoff, u64::from(table.link))?;
        let strtab = slice(bytes, strings.offset, strings.size, "string table")?;
        let entries = slice(bytes, table.offset, table.size, "symbol table")?;
        // Entry 0 is the reserved null symbol.
        for i in 1..(table.size / SYM_ENTRY_BYTES) {
            let at = i * SYM_ENTRY_BYTES;
            let name_offset = u32_at(entries, at, "st_name")?;
            let info = slice(entries, at + 4, 1, "st_info")?[0];
            let shndx = u16_at(entries, at + 6, "st_shndx")?;
            let size = u64_at(entries, at + 16, "st_size")?;
            symbols.push(ElfSymbol {
                name: name_at(strtab, u64::from(name_offset))?,
                kind: info & 0xf,
                defined: shndx != SHN_UNDEF,
                size,
            });
        }
    }
    Ok(ElfObject { machine, flags, symbols })
}

/// One entry of a clang offload bundle: the target triple (e.g.
/// `hipv4-amdgcn-amd-amdhsa--gfx942`) and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleEntry<'a> {
    /// The target triple ("" for a plain ELF file).
    pub triple: String,
    /// The entry's bytes.
    pub bytes: &'a [u8],
}

/// The code objects in `bytes`: a plain ELF file is one unnamed entry; an uncompressed
/// `__CLANG_OFFLOAD_BUNDLE__` yields its non-empty entries (the host entry is empty).
pub fn code_objects(bytes: &[u8]) -> Result<Vec<BundleEntry<'_>>, ElfError> {
    if bytes.starts_with(b"CCOB") {
        return Err(ElfError::CompressedBundle);
    }
    if !bytes.starts_with(BUNDLE_MAGIC) {
        return Ok(vec![BundleEntry { triple: String::new(), bytes }]);
    }
    let count = u64_at(bytes, BUNDLE_MAGIC.len() as u64, "bundle entry count")?;
    let mut at = BUNDLE_MAGIC.len() as u64 + 8;
    let mut entries = Vec::new();
    for _ in 0..count {
        let offset = u64_at(bytes, at, "bundle entry offset")?;
        let size = u64_at(bytes, at + 8, "bundle entry size")?;
        let triple_len = u64_at(bytes, at + 16, "bundle triple length")?;
        let triple = slice(bytes, at + 24, triple_len, "bundle triple")?;
        let triple = String::from_utf8_lossy(triple).into_owned();
        at = at.checked_add(24 + triple_len).ok_or(ElfError::Truncated {
            what: "bundle entry",
            offset: at,
            len: triple_len,
            size: bytes.len() as u64,
        })?;
        if size > 0 {
            entries.push(BundleEntry { triple, bytes: slice(bytes, offset, size, "bundle entry")? });
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 with one `.dynsym` naming `k` (FUNC) and `k.kd` (OBJECT), built by
    /// hand so the reader is tested without a compiler.
    fn tiny_object(machine: u16, flags: u32) -> Vec<u8> {
        let strtab: &[u8] = b"\0k\0k.kd\0";
        let mut syms = vec![0u8; 24]; // null symbol
        for (name, kind) in [(1u32, STT_FUNC), (3u32, STT_OBJECT)] {
            let mut e = [0u8; 24];
            e[0..4].copy_from_slice(&name.to_le_bytes());
            e[4] = 0x10 | kind; // GLOBAL
            e[6..8].copy_from_slice(&1u16.to_le_bytes());
            e[16..24].copy_from_slice(&64u64.to_le_bytes());
            syms.extend_from_slice(&e);
        }
        let strtab_off = 64u64;
        let syms_off = strtab_off + strtab.len() as u64;
        let shoff = syms_off + syms.len() as u64;
        let mut f = vec![0u8; 64];
        f[0..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[0x12..0x14].copy_from_slice(&machine.to_le_bytes());
        f[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        f[0x30..0x34].copy_from_slice(&flags.to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        f.extend_from_slice(strtab);
        f.extend_from_slice(&syms);
        let header = |kind: u32, off: u64, size: u64, link: u32, entsize: u64| {
            let mut h = [0u8; 64];
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[24..32].copy_from_slice(&off.to_le_bytes());
            h[32..40].copy_from_slice(&size.to_le_bytes());
            h[40..44].copy_from_slice(&link.to_le_bytes());
            h[56..64].copy_from_slice(&entsize.to_le_bytes());
            h
        };
        f.extend_from_slice(&[0u8; 64]);
        f.extend_from_slice(&header(3, strtab_off, strtab.len() as u64, 0, 0));
        f.extend_from_slice(&header(SHT_DYNSYM, syms_off, syms.len() as u64, 1, 24));
        f
    }

    #[test]
    fn reads_symbols_machine_and_flags() {
        let obj = parse(&tiny_object(EM_AMDGPU, 0x54c)).unwrap();
        assert_eq!(obj.machine, EM_AMDGPU);
        assert_eq!(obj.amdgpu_mach(), EF_AMDGPU_MACH_GFX942);
        let names: Vec<&str> = obj.symbols.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["k", "k.kd"]);
        assert!(obj.has_kernel("k"));
        assert!(!obj.has_kernel("k.kd"));
        assert!(!obj.has_kernel("v4pool_empty"));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = tiny_object(EM_AMDGPU, 0x53f);
        for len in 0..full.len() {
            assert!(parse(&full[..len]).is_err(), "truncated to {len} bytes parsed");
        }
    }

    #[test]
    fn corrupt_offsets_are_errors() {
        let mut f = tiny_object(EM_AMDGPU, 0);
        f[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&f), Err(ElfError::Truncated { .. })));
        assert!(matches!(parse(b"\x7fELF\x01\x01"), Err(ElfError::NotElf { .. })));
        let mut f = tiny_object(EM_AMDGPU, 0);
        f[4] = 1;
        assert_eq!(parse(&f), Err(ElfError::Unsupported { class: 1, data: 1 }));
        assert!(matches!(parse(b"MZ not elf at all"), Err(ElfError::NotElf { .. })));
    }

    #[test]
    fn unbundles_and_passes_plain_objects_through() {
        let obj = tiny_object(EM_AMDGPU, 0x54c);
        assert_eq!(code_objects(&obj).unwrap(), vec![BundleEntry { triple: String::new(), bytes: &obj }]);

        let triples = ["host-x86_64-unknown-linux-gnu-", "hipv4-amdgcn-amd-amdhsa--gfx942"];
        let header_len = BUNDLE_MAGIC.len() + 8 + triples.iter().map(|t| 24 + t.len()).sum::<usize>();
        let mut b = BUNDLE_MAGIC.to_vec();
        b.extend_from_slice(&2u64.to_le_bytes());
        for (t, (off, size)) in triples.iter().zip([(header_len, 0usize), (header_len, obj.len())]) {
            b.extend_from_slice(&(off as u64).to_le_bytes());
            b.extend_from_slice(&(size as u64).to_le_bytes());
            b.extend_from_slice(&(t.len() as u64).to_le_bytes());
            b.extend_from_slice(t.as_bytes());
        }
        b.extend_from_slice(&obj);
        let entries = code_objects(&b).unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].triple, triples[1]);
        assert!(parse(entries[0].bytes).unwrap().has_kernel("k"));
        assert!(code_objects(&b[..b.len() - 1]).is_err());
        assert_eq!(code_objects(b"CCOB...."), Err(ElfError::CompressedBundle));
    }
}
