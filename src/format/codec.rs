//! The scalar codecs every format (and the indexer's key formats) shares: the element and
//! scale encodings, each way. The device kernels transcribe these integer for integer
//! (kernels/kv_rows.cuh).

/// The e8m0 byte of a tile whose largest finite magnitude has f32 bits `amax`: 0 for an
/// all-zero tile, else the least `B` with `amax / 2^(B-127) <= 448` (the exponent of amax
/// minus 8, plus one when its mantissa passes 1.75; 448 = 1.75 x 2^8), at least 1.
pub fn e8m0_of_amax(amax: u32) -> u8 {
    e8m0_fitting(amax, E4M3FN_MAX)
}

/// f32 bits of e4m3fn's largest finite value, 448 (1.75 × 2^8).
pub const E4M3FN_MAX: u32 = 0x43e0_0000;
/// f32 bits of e4m3fnuz's largest finite value, 240 (1.875 × 2^7).
pub const E4M3FNUZ_MAX: u32 = 0x4370_0000;

/// The least e8m0 byte `B` with `amax / 2^(B-127) <= max` (both f32 bits, `max` a normal
/// float): the exponent of amax minus max's, plus one when amax's mantissa passes max's; 0 for
/// `amax = 0`, else at least 1 and at most 254. The one power-of-two scale rule every e8m0 and
/// power-of-two f32 scale here takes (kernels/kv_rows.cuh `v4p_e8m0_fitting`).
pub fn e8m0_fitting(amax: u32, max: u32) -> u8 {
    if amax == 0 {
        return 0;
    }
    let b =
        (amax >> 23) as i32 - ((max >> 23) as i32 - 127) + i32::from((amax & 0x7f_ffff) > (max & 0x7f_ffff));
    b.clamp(1, 254) as u8
}

/// The e4m3 magnitude code (no sign) of the positive finite f32 bits `a` under exponent bias
/// `bias` (7: e4m3fn, 8: e4m3fnuz), rounded to nearest even; a result past the format's largest
/// code is the caller's to saturate. f32 subnormals are 0.
fn e4m3_magnitude(a: u32, bias: i32) -> u32 {
    let e = (a >> 23) as i32 - 127;
    let (mut code, rem, half) = if e >= 1 - bias {
        ((((e + bias) as u32) << 3) | ((a & 0x7f_ffff) >> 20), a & 0xf_ffff, 0x8_0000u32)
    } else {
        if a >> 23 == 0 {
            return 0;
        }
        let m = (a & 0x7f_ffff) | 0x80_0000;
        // value / 2^(-2 - bias) (the subnormal step) = m >> sh; sh >= 21
        let sh = (21 - bias - e) as u32;
        if sh > 31 {
            return 0;
        }
        (m >> sh, m & ((1u32 << sh) - 1), 1u32 << (sh - 1))
    };
    if rem > half || (rem == half && code & 1 == 1) {
        code += 1;
    }
    code
}

/// f32 bits `u` as an e4m3fn byte, rounded to nearest even; magnitudes past 448 (and
/// infinities) saturate to 448, NaN is `0x7f` with the sign, f32 subnormals a signed zero.
pub fn e4m3_rne(u: u32) -> u8 {
    let s = ((u >> 24) & 0x80) as u8;
    let a = u & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return s | 0x7f;
    }
    if a >= E4M3FN_MAX {
        return s | 0x7e;
    }
    s | e4m3_magnitude(a, 7).min(0x7e) as u8
}

/// f32 bits `u` as an e4m3fnuz byte (exponent bias 8, largest 240, one NaN `0x80`, no negative
/// zero), rounded to nearest even, as aiter's conversion on gfx942 writes it
/// (`hip_float8_impl.h`: NaN and infinities become `0x80`, finite magnitudes past 240 clip to
/// 240, and a value that rounds to zero is `0x00` whatever its sign: `0x80` is not −0.0).
pub fn e4m3fnuz_rne(u: u32) -> u8 {
    let a = u & 0x7fff_ffff;
    if a >= 0x7f80_0000 {
        return 0x80;
    }
    let s = ((u >> 24) & 0x80) as u8;
    let code = if a >= E4M3FNUZ_MAX { 0x7f } else { e4m3_magnitude(a, 8).min(0x7f) as u8 };
    if code == 0 {
        0
    } else {
        s | code
    }
}

/// The value an e4m3fnuz byte encodes (NaN for `0x80`, the only NaN; no infinities).
pub fn e4m3fnuz_value(b: u8) -> f32 {
    if b == 0x80 {
        return f32::NAN;
    }
    // Every other byte is half the e4m3fn value of the same byte (bias 8 against 7), and
    // e4m3fn's NaN pattern 0x7f is fnuz's 240.
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    s * if e == 0 { m / 8.0 * 2f32.powi(-7) } else { (1.0 + m / 8.0) * 2f32.powi(e - 8) }
}

/// bf16 bits `v` times `inv` (1 / scale) as an e4m3fn byte: [`e4m3_rne`] of the product, but a
/// NaN value is `0x7f` with its own sign. A product's NaN sign is the platform's (x86 keeps the
/// operand's, NVIDIA GPUs return a canonical NaN), so the rule is on the input, and every
/// backend writes the same byte (kv_rows.cuh `v4p_e4m3_scaled`).
pub fn e4m3_of_scaled_bf16(v: u16, inv: f32) -> u8 {
    if v & 0x7fff > 0x7f80 {
        return ((v >> 8) as u8 & 0x80) | 0x7f;
    }
    e4m3_rne((f32::from_bits(u32::from(v) << 16) * inv).to_bits())
}

/// bf16 bits `v` times `inv` as an e2m1 nibble: [`e2m1_rne`] of the product, a NaN value 6 with
/// its own sign (as [`e4m3_of_scaled_bf16`]; kv_rows.cuh `v4p_e2m1_scaled`).
pub fn e2m1_of_scaled_bf16(v: u16, inv: f32) -> u8 {
    if v & 0x7fff > 0x7f80 {
        return ((v >> 12) as u8 & 0x8) | 0x7;
    }
    e2m1_rne((f32::from_bits(u32::from(v) << 16) * inv).to_bits())
}

/// The e8m0 byte of a group whose largest magnitude has f32 bits `amax`, fitting e2m1's 6: 0
/// for an all-zero group, else the exponent of amax minus 2, plus one when its mantissa passes
/// 1.5 (6 = 1.5 × 2^2), at least 1 (at most 253, for amax = inf).
pub fn e8m0_of_amax_e2m1(amax: u32) -> u8 {
    e8m0_fitting(amax, 0x40c0_0000)
}

/// f32 bits `u` as an e2m1 nibble (sign in bit 3), rounded to the nearest even code: codes
/// 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; 6 and past (infinities, NaN) saturate to 6.
pub fn e2m1_rne(u: u32) -> u8 {
    let s = ((u >> 28) & 0x8) as u8;
    let a = u & 0x7fff_ffff; // positive f32 bits order as their values
                             // Upper midpoint of each code: even codes keep their tie (`<=`), odd ones pass it on.
    const EDGES: [(u32, bool); 7] = [
        (0x3e80_0000, true),  // 0.25
        (0x3f40_0000, false), // 0.75
        (0x3fa0_0000, true),  // 1.25
        (0x3fe0_0000, false), // 1.75
        (0x4020_0000, true),  // 2.5
        (0x4060_0000, false), // 3.5
        (0x40a0_0000, true),  // 5
    ];
    let code = EDGES.iter().position(|&(edge, even)| if even { a <= edge } else { a < edge }).unwrap_or(7);
    s | code as u8
}

pub(super) fn amax_of(x: &[u16]) -> u32 {
    // bf16 bits widened to f32 bits; NaN is never the amax, infinities count.
    x.iter().map(|&v| (u32::from(v) << 16) & 0x7fff_ffff).filter(|&m| m <= 0x7f80_0000).max().unwrap_or(0)
}

/// The value an e4m3fn byte encodes (NaN for `0x7f` / `0xff`).
pub fn e4m3_value(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    s * if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// The value an e2m1 nibble encodes.
pub fn e2m1_value(n: u8) -> f32 {
    const V: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = V[usize::from(n & 7)];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// The scale an e8m0 byte encodes, `2^(B-127)` (0 for `B = 0`, which v4pool's own rule writes for
/// an all-zero tile; NaN for 255).
pub fn e8m0_value(b: u8) -> f32 {
    match b {
        0 => 0.0,
        255 => f32::NAN,
        _ => 2f32.powi(i32::from(b) - 127),
    }
}
