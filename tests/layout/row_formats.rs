//! The row formats' bytes against a decoder written from the formats' text alone (FlashMLA's
//! `flash_mla_interface.py` notes, as issue 33 quotes them), not from `v4pool::format`:
//!
//! - V4, 584 B a token in pages of 64: a page holds its 64 data rows (448 e4m3 NoPE, then 64 bf16
//!   RoPE = 576 B) first, then its 64 scale rows of 8 B (7 e8m0, one per 64 NoPE values, a pad).
//!   `flashmla-v4-p2`: the same rows in pages of 2 (2 data rows, then their 2 scale rows).
//! - V4.1, 528 B interleaved: 512 e4m3 (RoPE quantised too), then 16 e8m0, one per 32 values.
//! - V4.1 fp4, 288 B interleaved: 256 B e2m1 (even index in the low nibble), then 32 e4m3
//!   scales, one per 16 values.
//! - ATOM's (today's fp8): a 512-B NoPE row (448 e4m3, the 7 e8m0 tile scales each twice, zero
//!   pad) and a 128-B RoPE row of 64 bf16.
//!
//! Rows are packed by `v4pool::format` into poisoned planes at scattered rows (across page
//! boundaries), decoded here, and compared with the values the format's own unpack gives and
//! with the input within the encoding's error; bytes of other rows stay poisoned.

use v4pool::format::{RowFormatId, ALL};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64, written out: this file shares nothing with the library it checks.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn bf16(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}
fn from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; exponent 0 subnormal; S.1111.111 NaN.
fn e4m3(b: u8) -> f32 {
    let sign = if b >> 7 == 1 { -1.0f32 } else { 1.0 };
    let exp = (b >> 3) & 0xf;
    let man = (b & 7) as f32;
    if exp == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * 2f32.powi(-9)
    } else {
        sign * (8.0 + man) * 2f32.powi(exp as i32 - 10)
    }
}
fn e8m0(b: u8) -> f32 {
    2f32.powi(b as i32 - 127)
}
fn e2m1(n: u8) -> f32 {
    let mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(n & 7) as usize];
    if n & 8 == 8 {
        -mag
    } else {
        mag
    }
}

/// Token `t`'s 512 values from the planes of `format`, by the text above.
fn decode(format: RowFormatId, planes: &[Vec<u8>], t: usize) -> Vec<f32> {
    let mut out = vec![0f32; 512];
    match format {
        RowFormatId::FlashMlaV4 | RowFormatId::FlashMlaV4P2 => {
            let p = if format == RowFormatId::FlashMlaV4 { 64 } else { 2 };
            let page = &planes[0][(t / p) * p * 584..];
            let data = &page[(t % p) * 576..][..576];
            let scales = &page[p * 576 + (t % p) * 8..][..8];
            for i in 0..448 {
                out[i] = e4m3(data[i]) * e8m0(scales[i / 64]);
            }
            for i in 0..64 {
                out[448 + i] = from_bf16(u16::from_le_bytes([data[448 + 2 * i], data[449 + 2 * i]]));
            }
        }
        RowFormatId::FlashMlaV41 => {
            let row = &planes[0][t * 528..][..528];
            for i in 0..512 {
                out[i] = e4m3(row[i]) * e8m0(row[512 + i / 32]);
            }
        }
        RowFormatId::FlashMlaV41Fp4 => {
            let row = &planes[0][t * 288..][..288];
            for i in 0..512 {
                let nibble = if i % 2 == 0 { row[i / 2] & 0xf } else { row[i / 2] >> 4 };
                out[i] = e2m1(nibble) * e4m3(row[256 + i / 16]);
            }
        }
        RowFormatId::AtomFp8 => {
            let nope = &planes[0][t * 512..][..512];
            let rope = &planes[1][t * 128..][..128];
            for tile in 0..7 {
                assert_eq!(nope[448 + 2 * tile], nope[449 + 2 * tile], "ATOM stores each scale twice");
            }
            assert!(nope[462..].iter().all(|&b| b == 0), "ATOM's pad is zero");
            for i in 0..448 {
                // v4pool's own rule writes B = 0 for an all-zero tile (scale 0, values 0).
                let b = nope[448 + 2 * (i / 64)];
                out[i] = if b == 0 { 0.0 } else { e4m3(nope[i]) * e8m0(b) };
            }
            for i in 0..64 {
                out[448 + i] = from_bf16(u16::from_le_bytes([rope[2 * i], rope[2 * i + 1]]));
            }
        }
        RowFormatId::Bf16 => {
            let row = &planes[0][t * 1024..][..1024];
            for i in 0..512 {
                out[i] = from_bf16(u16::from_le_bytes([row[2 * i], row[2 * i + 1]]));
            }
        }
    }
    out
}

/// Largest error the encoding allows, relative to the amax of the value's scale group.
fn tolerance(format: RowFormatId, i: usize) -> f32 {
    match format {
        RowFormatId::Bf16 => 0.0,
        RowFormatId::FlashMlaV41Fp4 => 0.26, // e2m1 steps of 2 below 6 (×amax/6), scale rounding
        RowFormatId::AtomFp8 | RowFormatId::FlashMlaV4 | RowFormatId::FlashMlaV4P2 if i >= 448 => 0.0, // bf16 RoPE
        _ => 1.0 / 16.0, // e4m3: 3 mantissa bits, round to nearest
    }
}

#[test]
fn every_format_decodes_by_its_text() {
    const { assert!(cfg!(target_endian = "little"), "the formats are little-endian byte layouts") };
    let mut rng = Rng(0x33);
    for format in ALL {
        let f = format.format();
        let tokens = 200usize; // four pages of 64 and a partial one
        let mut planes: Vec<Vec<u8>> = f
            .planes
            .iter()
            .map(|p| vec![0xc3u8; tokens.div_ceil(64) * 64 * p.row_bytes() as usize])
            .collect();
        let rows = [0usize, 1, 62, 63, 64, 65, 127, 128, 130, 191, 199];
        let mut inputs = Vec::new();
        for &t in &rows {
            // Per-32 magnitudes from 2^-6 to 2^6, one all-zero group in some rows, sign mixed.
            let zero_group = if t % 3 == 0 { Some(t % 16) } else { None };
            let kv: Vec<u16> = (0..512)
                .map(|i| {
                    if zero_group == Some(i / 32) {
                        return 0;
                    }
                    let mag = 2f32.powi(((i / 32 + t) % 13) as i32 - 6);
                    bf16(rng.unit() * mag)
                })
                .collect();
            let packed = f.pack(&kv).unwrap();
            let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
            f.place(t as u64, &packed, &mut views).unwrap();
            inputs.push((t, kv, packed));
        }
        for (t, kv, packed) in &inputs {
            let got = decode(format, &planes, *t);
            let refs: Vec<&[u8]> = packed.iter().map(|v| v.as_slice()).collect();
            let own = f.unpack(&refs).unwrap();
            for i in 0..512 {
                assert_eq!(
                    got[i].to_bits(),
                    own[i].to_bits(),
                    "{} token {t} value {i}: text vs unpack",
                    f.name
                );
                let x = from_bf16(kv[i]);
                let group = match format {
                    RowFormatId::FlashMlaV41Fp4 => 16,
                    RowFormatId::FlashMlaV41 => 32,
                    _ if i >= 448 => 1,
                    _ => 64,
                };
                let g0 = i / group * group;
                let amax = kv[g0..g0 + group].iter().map(|&v| from_bf16(v).abs()).fold(0f32, f32::max);
                let err = (got[i] - x).abs();
                assert!(
                    err <= tolerance(format, i) * amax,
                    "{} token {t} value {i}: {} vs {x}",
                    f.name,
                    got[i]
                );
            }
        }
        // Every byte not in a written row is still poison.
        for (p, plane) in f.planes.iter().zip(&planes) {
            let mut owned = vec![false; plane.len()];
            for &t in &rows {
                for (off, len) in p.row_spans(t as u64, 1).unwrap() {
                    owned[off as usize..(off + len) as usize].iter_mut().for_each(|o| *o = true);
                }
            }
            for (i, (&b, &o)) in plane.iter().zip(&owned).enumerate() {
                assert!(o || b == 0xc3, "{}: byte {i} outside the written rows changed", f.name);
            }
        }
    }
}

#[test]
fn flashmla_v4_pages_keep_data_before_scales() {
    // Token 65's data row is at page 1 + 1 × 576; its scale row after the page's 64 data rows.
    let f = RowFormatId::FlashMlaV4.format();
    let p = &f.planes[0];
    assert_eq!(p.byte_offset(65, 0), Some(64 * 584 + 576));
    assert_eq!(p.byte_offset(65, 1), Some(64 * 584 + 64 * 576 + 8));
    // Two tokens of one page: data spans and scale spans apart.
    assert_eq!(p.row_spans(10, 2), Some(vec![(10 * 576, 2 * 576), (64 * 576 + 80, 16)]));
}

#[test]
fn atom_fp8_description_is_the_kernel_pack_byte_for_byte() {
    // The description of today's format reproduces the verified pack (the kernel's formula,
    // `index::host::pack_fp8_row`) on random rows, all-zero tiles among them.
    let mut rng = Rng(0x640);
    for case in 0..64 {
        let kv: Vec<u16> = (0..512)
            .map(|i| if case % 5 == 0 && i < 64 { 0 } else { bf16(rng.unit() * 2f32.powi(i / 64 - 3)) })
            .collect();
        let (mut nope, mut rope) = (vec![0xa5u8; 512], vec![0x5au8; 128]);
        v4pool::raw::index::host::pack_fp8_row(&kv, &mut nope, &mut rope).unwrap();
        assert_eq!(RowFormatId::AtomFp8.format().pack(&kv).unwrap(), vec![nope, rope], "case {case}");
    }
}

/// defect43 row 12: `place` with a packed image shorter than the format's row (or fewer
/// images or planes than the format has) panicked on a slice index (or wrote part of a row and
/// said `Some`): `None`, as for a row outside the planes, and the planes untouched.
#[test]
fn place_refuses_images_that_are_not_the_formats_rows() {
    for id in ALL {
        let f = id.format();
        let sizes: Vec<usize> = f.planes.iter().map(|p| p.row_bytes() as usize).collect();
        let mut planes: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xc3u8; 64 * n]).collect();
        let good: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![7u8; n]).collect();
        let mut short = good.clone();
        short[0].truncate(10);
        let mut long = good.clone();
        long[0].push(1);
        for (what, packed) in
            [("a 10-byte image", short), ("a longer image", long), ("too few images", vec![])]
        {
            let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
            assert_eq!(f.place(0, &packed, &mut views), None, "{}: {what}", f.name);
        }
        if sizes.len() > 1 {
            let mut views: Vec<&mut [u8]> = planes.iter_mut().take(1).map(|v| v.as_mut_slice()).collect();
            assert_eq!(f.place(0, &good, &mut views), None, "{}: too few planes", f.name);
        }
        assert!(planes.iter().all(|p| p.iter().all(|&b| b == 0xc3)), "{}: a refused place wrote", f.name);
        let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
        assert_eq!(f.place(3, &good, &mut views), Some(()), "{}", f.name);
    }
}

/// defect43 row 13: `row_spans(0, 1 << 40)` on the paged plane walked 2^34 pages (past 30 s):
/// rows past any plane (`geometry::MAX_PLANE_ROWS`) are refused up front, and the tallest
/// plane's rows come back at once (whole pages are one span, so the work does not grow with
/// the count); every run equals the per-row spans merged.
#[test]
fn row_spans_are_bounded_work() {
    let max = v4pool::format::MAX_ROWS;
    assert_eq!(max, v4pool::geometry::MAX_PLANE_ROWS as u64, "one bound for plane rows");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for id in ALL {
            for p in id.format().planes {
                let _ = tx.send((p.row_spans(0, 1 << 40), p.row_spans(1, max), p.row_spans(0, max)));
            }
        }
    });
    let mut n = 0;
    for id in ALL {
        for p in id.format().planes {
            let (past, past_by_one, tallest) =
                rx.recv_timeout(std::time::Duration::from_secs(5)).expect("row_spans did not return in 5 s");
            assert_eq!(past, None, "{}: rows past any plane", id.format().name);
            assert_eq!(past_by_one, None, "{}: one row past the tallest plane", id.format().name);
            let tallest = tallest.expect("the tallest plane's rows");
            assert_eq!(tallest.iter().map(|s| s.1).sum::<u64>(), max * p.row_bytes(), "{}", id.format().name);
            n += 1;
        }
    }
    assert!(n > 0);
    // Random runs against the per-row spans, merged where they abut.
    let mut rng = Rng(0x5a4);
    for id in ALL {
        for p in id.format().planes {
            for _ in 0..200 {
                let first = rng.next() % 300;
                let rows = rng.next() % 300;
                let mut want: Vec<(u64, u64)> = Vec::new();
                let mut spans: Vec<(u64, u64)> = Vec::new();
                for r in first..first + rows {
                    for (k, &w) in p.regions.iter().enumerate() {
                        spans.push((p.byte_offset(r, k).unwrap(), w));
                    }
                }
                spans.sort_unstable();
                for (o, l) in spans {
                    match want.last_mut() {
                        Some((wo, wl)) if *wo + *wl == o => *wl += l,
                        _ => want.push((o, l)),
                    }
                }
                assert_eq!(p.row_spans(first, rows), Some(want), "{} rows {first}+{rows}", id.format().name);
            }
        }
    }
}

/// `#define NAME value` lines of kernels/v4pool_common.h whose name starts with `prefix`.
fn kernel_codes(prefix: &str) -> Vec<(String, i32)> {
    include_str!("../../kernels/v4pool_common.h")
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("#define ")?.split_whitespace();
            let (name, value) = (w.next()?, w.next()?);
            name.starts_with(prefix).then(|| (name.to_string(), value.parse().expect("a code")))
        })
        .collect()
}

#[test]
fn the_kernels_format_codes_are_the_descriptions() {
    // Each row format and indexer dtype has the one code its description gives, under the
    // kernel header's name for it, and the header names no other: a format added, renumbered
    // or dropped on one side fails here.
    use v4pool::sizing::IndexerDtype;
    let rows: Vec<(String, i32)> = ALL
        .iter()
        .map(|f| {
            let name = f.format().name.to_uppercase().replace('-', "_");
            (format!("V4P_KV_ROWS_{name}"), f.kernel_code())
        })
        .collect();
    let mut want = rows.clone();
    want.sort();
    let mut got = kernel_codes("V4P_KV_ROWS_");
    got.sort();
    assert_eq!(got, want);
    let mut want: Vec<(String, i32)> = IndexerDtype::ALL
        .iter()
        .map(|d| {
            (format!("V4P_INDEX_KEYS_{}", d.name().to_uppercase().replace('-', "_")), d.key_format_code())
        })
        .collect();
    want.sort();
    let mut got = kernel_codes("V4P_INDEX_KEYS_");
    got.sort();
    assert_eq!(got, want);
    // And the Rust constants the launchers pass are the same codes.
    use v4pool::raw::index::*;
    assert_eq!(
        [
            KV_ROWS_BF16,
            KV_ROWS_ATOM_FP8,
            KV_ROWS_FLASHMLA_V41,
            KV_ROWS_FLASHMLA_V4,
            KV_ROWS_FLASHMLA_V41_FP4,
            KV_ROWS_FLASHMLA_V4_P2
        ],
        [
            RowFormatId::Bf16.kernel_code(),
            RowFormatId::AtomFp8.kernel_code(),
            RowFormatId::FlashMlaV41.kernel_code(),
            RowFormatId::FlashMlaV4.kernel_code(),
            RowFormatId::FlashMlaV41Fp4.kernel_code(),
            RowFormatId::FlashMlaV4P2.kernel_code(),
        ]
    );
    for f in ALL {
        assert_eq!(RowFormatId::from_kernel_code(f.kernel_code()), Some(f));
    }
    assert_eq!(RowFormatId::from_kernel_code(6), None);
    // The page of each paged format, as the kernel's page arithmetic takes it: a
    // `V4P_PAGE_ROWS_<NAME>` line per paged format, the description's `page_rows`, no other.
    let mut want: Vec<(String, i32)> = ALL
        .iter()
        .filter(|f| f.format().is_paged())
        .map(|f| {
            let name = f.format().name.to_uppercase().replace('-', "_");
            (format!("V4P_PAGE_ROWS_{name}"), f.format().planes[0].page_rows as i32)
        })
        .collect();
    want.sort();
    let mut got = kernel_codes("V4P_PAGE_ROWS_");
    got.sort();
    assert_eq!(got, want);
}
