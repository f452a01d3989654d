// code_object.h — reading an AMDGPU code object the way a HIP runtime must before it launches
// anything: the ELF (or a clang offload bundle around it), its symbols, and the kernels'
// facts in the NT_AMDGPU_METADATA note (a msgpack map, code object v3+).
//
// Every read is bounded by the image's size; malformed input is a `CodeObjectError` with a
// message, never a crash. Only what the double checks is kept.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace hipdbl {

struct CodeObjectError {
    std::string message;
};

/// One explicit or hidden kernel argument of the metadata's `.args` list.
struct KernelArg {
    uint64_t offset = 0, size = 0;
    std::string value_kind;
    bool hidden() const { return value_kind.rfind("hidden_", 0) == 0; }
};

/// One entry of `amdhsa.kernels`.
struct KernelInfo {
    std::string name, symbol;
    uint64_t kernarg_segment_size = 0, kernarg_segment_align = 0;
    uint64_t max_flat_workgroup_size = 0, wavefront_size = 0;
    uint64_t group_segment_fixed_size = 0, private_segment_fixed_size = 0;
    std::vector<KernelArg> args;
    /// End of the last explicit argument: the bytes a caller's argument buffer must hold.
    uint64_t explicit_bytes() const {
        uint64_t end = 0;
        for (const auto& a : args)
            if (!a.hidden() && a.offset + a.size > end) end = a.offset + a.size;
        return end;
    }
    size_t explicit_count() const {
        size_t n = 0;
        for (const auto& a : args) n += a.hidden() ? 0 : 1;
        return n;
    }
};

struct CodeObject {
    uint16_t machine = 0;
    uint32_t flags = 0;
    uint8_t abi_version = 0;
    std::map<std::string, KernelInfo> kernels;
    /// Names of the ELF's defined symbols (functions and `.kd` descriptors).
    std::vector<std::string> symbols;
    uint32_t mach() const { return flags & 0xffu; }
    bool has_symbol(const std::string& s) const {
        for (const auto& x : symbols)
            if (x == s) return true;
        return false;
    }
};

constexpr uint16_t EM_AMDGPU = 224;
constexpr uint32_t NT_AMDGPU_METADATA = 32;
constexpr uint32_t MACH_GFX90A = 0x3f;
constexpr uint32_t MACH_GFX942 = 0x4c;

/// The processor an arch string names ("gfx942:sramecc+:xnack-" -> 0x4c); 0 if unknown.
inline uint32_t mach_of_arch(const std::string& arch) {
    const std::string p = arch.substr(0, arch.find(':'));
    if (p == "gfx942") return MACH_GFX942;
    if (p == "gfx90a") return MACH_GFX90A;
    return 0;
}

// ---- bounded reads ------------------------------------------------------------------------

class Bytes {
  public:
    Bytes(const uint8_t* p, size_t n) : p_(p), n_(n) {}
    size_t size() const { return n_; }
    template <typename T>
    T le(size_t at, const char* what) const {
        if (at > n_ || sizeof(T) > n_ - at) throw CodeObjectError{std::string("truncated reading ") + what};
        T v;
        std::memcpy(&v, p_ + at, sizeof(T));  // x86-64 and the ELF are little-endian
        return v;
    }
    Bytes sub(uint64_t at, uint64_t len, const char* what) const {
        if (at > n_ || len > n_ - at) throw CodeObjectError{std::string(what) + " lies outside the image"};
        return Bytes(p_ + at, static_cast<size_t>(len));
    }
    const uint8_t* data() const { return p_; }

  private:
    const uint8_t* p_;
    size_t n_;
};

// ---- msgpack: the subset the metadata note uses, as a tree --------------------------------

struct Msg {
    enum Kind { Nil, Bool, Int, Str, Arr, Map, Other } kind = Nil;
    uint64_t u = 0;
    bool negative = false;
    std::string s;
    std::vector<Msg> items;                         // Arr
    std::vector<std::pair<Msg, Msg>> entries;       // Map
    const Msg* get(const char* key) const {
        if (kind != Map) return nullptr;
        for (const auto& e : entries)
            if (e.first.kind == Str && e.first.s == key) return &e.second;
        return nullptr;
    }
};

class MsgReader {
  public:
    explicit MsgReader(Bytes b) : b_(b) {}
    Msg read(int depth = 0) {
        if (depth > 16) throw CodeObjectError{"metadata nests deeper than 16 levels"};
        // Each element costs at least one byte, so a container can never claim more than this.
        Msg m;
        const uint8_t t = b_.le<uint8_t>(at_++, "msgpack tag");
        auto str = [&](uint64_t len) {
            Bytes s = b_.sub(at_, len, "msgpack string");
            m.kind = Msg::Str;
            m.s.assign(reinterpret_cast<const char*>(s.data()), s.size());
            at_ += len;
        };
        auto arr = [&](uint64_t n) {
            if (n > b_.size() - at_) throw CodeObjectError{"msgpack array longer than the note"};
            m.kind = Msg::Arr;
            for (uint64_t i = 0; i < n; ++i) m.items.push_back(read(depth + 1));
        };
        auto map = [&](uint64_t n) {
            if (n > b_.size() - at_) throw CodeObjectError{"msgpack map longer than the note"};
            m.kind = Msg::Map;
            for (uint64_t i = 0; i < n; ++i) {
                Msg k = read(depth + 1);
                Msg v = read(depth + 1);
                m.entries.emplace_back(std::move(k), std::move(v));
            }
        };
        auto uint = [&](uint64_t v) { m.kind = Msg::Int, m.u = v; };
        if (t <= 0x7f) uint(t);
        else if (t >= 0xe0) m.kind = Msg::Int, m.negative = true, m.u = 0x100u - t;
        else if ((t & 0xf0) == 0x80) map(t & 0x0f);
        else if ((t & 0xf0) == 0x90) arr(t & 0x0f);
        else if ((t & 0xe0) == 0xa0) str(t & 0x1f);
        else switch (t) {
            case 0xc0: m.kind = Msg::Nil; break;
            case 0xc2: case 0xc3: m.kind = Msg::Bool, m.u = t & 1; break;
            case 0xcc: uint(b_.le<uint8_t>(at_, "u8")), at_ += 1; break;
            case 0xcd: uint(be16()); break;
            case 0xce: uint(be32()); break;
            case 0xcf: uint(be64()); break;
            case 0xd0: m.kind = Msg::Int, m.negative = true, at_ += 1; break;  // small negatives: unused
            case 0xd1: m.kind = Msg::Int, m.negative = true, at_ += 2; break;
            case 0xd2: m.kind = Msg::Int, m.negative = true, at_ += 4; break;
            case 0xd3: m.kind = Msg::Int, m.negative = true, at_ += 8; break;
            case 0xd9: { uint64_t n = b_.le<uint8_t>(at_, "str8 length"); at_ += 1; str(n); break; }
            case 0xda: str(be16()); break;
            case 0xdb: str(be32()); break;
            case 0xdc: arr(be16()); break;
            case 0xdd: arr(be32()); break;
            case 0xde: map(be16()); break;
            case 0xdf: map(be32()); break;
            case 0xca: m.kind = Msg::Other, at_ += 4; break;  // float32
            case 0xcb: m.kind = Msg::Other, at_ += 8; break;  // float64
            case 0xc4: { uint64_t n = b_.le<uint8_t>(at_, "bin8"); at_ += 1 + n; m.kind = Msg::Other; break; }
            default: throw CodeObjectError{"unsupported msgpack tag " + std::to_string(t)};
        }
        if (at_ > b_.size()) throw CodeObjectError{"msgpack value runs past the note"};
        return m;
    }
    size_t at() const { return at_; }

  private:
    uint64_t be(int n) {
        uint64_t v = 0;
        for (int i = 0; i < n; ++i) v = (v << 8) | b_.le<uint8_t>(at_ + i, "msgpack integer");
        at_ += n;
        return v;
    }
    uint64_t be16() { return be(2); }
    uint64_t be32() { return be(4); }
    uint64_t be64() { return be(8); }
    Bytes b_;
    size_t at_ = 0;
};

inline uint64_t need_uint(const Msg& kernel, const char* key, const std::string& name) {
    const Msg* v = kernel.get(key);
    if (!v || v->kind != Msg::Int || v->negative)
        throw CodeObjectError{"kernel " + name + ": metadata lacks an unsigned " + key};
    return v->u;
}

inline void read_metadata(Bytes desc, CodeObject& co) {
    MsgReader r(desc);
    Msg root = r.read();
    const Msg* kernels = root.get("amdhsa.kernels");
    if (!kernels || kernels->kind != Msg::Arr) throw CodeObjectError{"metadata has no amdhsa.kernels list"};
    for (const Msg& k : kernels->items) {
        const Msg* name = k.get(".name");
        const Msg* symbol = k.get(".symbol");
        if (!name || name->kind != Msg::Str || !symbol || symbol->kind != Msg::Str)
            throw CodeObjectError{"a kernel's metadata lacks .name or .symbol"};
        KernelInfo info;
        info.name = name->s;
        info.symbol = symbol->s;
        info.kernarg_segment_size = need_uint(k, ".kernarg_segment_size", info.name);
        info.kernarg_segment_align = need_uint(k, ".kernarg_segment_align", info.name);
        info.max_flat_workgroup_size = need_uint(k, ".max_flat_workgroup_size", info.name);
        info.wavefront_size = need_uint(k, ".wavefront_size", info.name);
        info.group_segment_fixed_size = need_uint(k, ".group_segment_fixed_size", info.name);
        info.private_segment_fixed_size = need_uint(k, ".private_segment_fixed_size", info.name);
        if (const Msg* args = k.get(".args")) {
            if (args->kind != Msg::Arr) throw CodeObjectError{"kernel " + info.name + ": .args is not a list"};
            for (const Msg& a : args->items) {
                KernelArg arg;
                arg.offset = need_uint(a, ".offset", info.name);
                arg.size = need_uint(a, ".size", info.name);
                const Msg* kind = a.get(".value_kind");
                if (!kind || kind->kind != Msg::Str) throw CodeObjectError{"kernel " + info.name + ": argument without .value_kind"};
                arg.value_kind = kind->s;
                if (arg.offset + arg.size > info.kernarg_segment_size || arg.offset + arg.size < arg.offset)
                    throw CodeObjectError{"kernel " + info.name + ": an argument ends past .kernarg_segment_size"};
                info.args.push_back(arg);
            }
        }
        if (!co.kernels.emplace(info.name, info).second)
            throw CodeObjectError{"kernel " + info.name + " listed twice in the metadata"};
    }
}

/// The AMDGPU ELF inside `image`: the image itself, or the amdgcn entry of a clang offload
/// bundle (what hiprtc and bundling clang emit).
inline Bytes unwrap_bundle(Bytes image) {
    static const char magic[] = "__CLANG_OFFLOAD_BUNDLE__";
    if (image.size() < 24 || std::memcmp(image.data(), magic, 24) != 0) return image;
    const uint64_t n = image.le<uint64_t>(24, "bundle entry count");
    size_t at = 32;
    for (uint64_t i = 0; i < n && i < 64; ++i) {
        const uint64_t off = image.le<uint64_t>(at, "bundle offset");
        const uint64_t size = image.le<uint64_t>(at + 8, "bundle size");
        const uint64_t idlen = image.le<uint64_t>(at + 16, "bundle id length");
        Bytes id = image.sub(at + 24, idlen, "bundle id");
        at += 24 + idlen;
        const std::string ids(reinterpret_cast<const char*>(id.data()), id.size());
        if (ids.find("amdgcn") != std::string::npos && size > 0) return image.sub(off, size, "bundle entry");
    }
    throw CodeObjectError{"offload bundle holds no amdgcn code object"};
}

/// Parse a code object. `image_len` bounds every read.
inline CodeObject parse_code_object(const uint8_t* image, size_t image_len) {
    Bytes b = unwrap_bundle(Bytes(image, image_len));
    if (b.size() < 64 || std::memcmp(b.data(), "\x7f" "ELF", 4) != 0) throw CodeObjectError{"not an ELF image"};
    if (b.le<uint8_t>(4, "class") != 2 || b.le<uint8_t>(5, "data") != 1)
        throw CodeObjectError{"not a 64-bit little-endian ELF"};
    CodeObject co;
    co.abi_version = b.le<uint8_t>(8, "ABI version");
    co.machine = b.le<uint16_t>(18, "e_machine");
    co.flags = b.le<uint32_t>(48, "e_flags");
    if (co.machine != EM_AMDGPU) throw CodeObjectError{"e_machine " + std::to_string(co.machine) + " is not EM_AMDGPU"};
    const uint64_t shoff = b.le<uint64_t>(40, "e_shoff");
    const uint16_t shentsize = b.le<uint16_t>(58, "e_shentsize");
    const uint16_t shnum = b.le<uint16_t>(60, "e_shnum");
    if (shentsize != 64) throw CodeObjectError{"unexpected section header size"};
    if (shoff > b.size()) throw CodeObjectError{"section headers lie outside the image"};
    struct Sec {
        uint32_t type, link;
        uint64_t off, size, entsize;
    };
    std::vector<Sec> secs;
    for (uint16_t i = 0; i < shnum; ++i) {
        Bytes h = b.sub(shoff + uint64_t(i) * 64, 64, "section header");
        secs.push_back({h.le<uint32_t>(4, "sh_type"), h.le<uint32_t>(40, "sh_link"), h.le<uint64_t>(24, "sh_offset"),
                        h.le<uint64_t>(32, "sh_size"), h.le<uint64_t>(56, "sh_entsize")});
    }
    bool metadata = false;
    for (const Sec& s : secs) {
        if (s.type == 7 /* SHT_NOTE */) {
            Bytes notes = b.sub(s.off, s.size, "note section");
            size_t at = 0;
            while (at + 12 <= notes.size()) {
                const uint32_t namesz = notes.le<uint32_t>(at, "note namesz");
                const uint32_t descsz = notes.le<uint32_t>(at + 4, "note descsz");
                const uint32_t type = notes.le<uint32_t>(at + 8, "note type");
                const uint64_t name_at = at + 12, desc_at = name_at + ((uint64_t(namesz) + 3) & ~uint64_t(3));
                Bytes name = notes.sub(name_at, namesz, "note name");
                Bytes desc = notes.sub(desc_at, descsz, "note description");
                if (type == NT_AMDGPU_METADATA && namesz == 7 && std::memcmp(name.data(), "AMDGPU", 7) == 0) {
                    if (metadata) throw CodeObjectError{"two AMDGPU metadata notes"};
                    read_metadata(desc, co);
                    metadata = true;
                }
                at = desc_at + ((uint64_t(descsz) + 3) & ~uint64_t(3));
            }
        } else if (s.type == 2 /* SHT_SYMTAB */ || s.type == 11 /* SHT_DYNSYM */) {
            if (s.entsize != 24 || s.link >= secs.size()) throw CodeObjectError{"malformed symbol table"};
            Bytes syms = b.sub(s.off, s.size, "symbol table");
            Bytes strs = b.sub(secs[s.link].off, secs[s.link].size, "string table");
            for (uint64_t at = 24; at + 24 <= syms.size(); at += 24) {  // entry 0 is the null symbol
                const uint32_t name = syms.le<uint32_t>(at, "st_name");
                const uint16_t shndx = syms.le<uint16_t>(at + 6, "st_shndx");
                if (shndx == 0 || name >= strs.size()) continue;  // undefined, or no name
                const char* p = reinterpret_cast<const char*>(strs.data()) + name;
                const size_t len = strnlen(p, strs.size() - name);
                if (len == strs.size() - name) throw CodeObjectError{"symbol name not NUL-terminated"};
                co.symbols.emplace_back(p, len);
            }
        }
    }
    if (!metadata) throw CodeObjectError{"no NT_AMDGPU_METADATA note"};
    for (const auto& [name, k] : co.kernels)
        if (!co.has_symbol(k.symbol) || !co.has_symbol(name))
            throw CodeObjectError{"kernel " + name + ": metadata names it, the symbol table lacks " + name + " or " + k.symbol};
    return co;
}

}  // namespace hipdbl
