use super::*;
use crate::rng::Rng;

fn random_row(rng: &mut Rng) -> Vec<u16> {
    // Varied magnitudes per tile so scales differ; never all zero.
    (0..KV_ROW_VALUES)
        .map(|i| {
            let mag = 2f32.powi((i / 32) as i32 % 9 - 4);
            let v = (rng.below(2001) as f32 / 1000.0 - 1.0) * mag;
            (v.to_bits() >> 16) as u16
        })
        .collect()
}

#[test]
fn a_scaled_nan_keeps_the_input_sign_and_the_rest_is_the_product_rounded() {
    // The rule is on the input, whatever sign the platform gives a product's NaN.
    for (v, e4m3, e2m1) in
        [(0x7fc1u16, 0x7fu8, 0x7u8), (0xffc1, 0xff, 0xf), (0x7f81, 0x7f, 0x7), (0xff80, 0xfe, 0xf)]
    {
        assert_eq!(e4m3_of_scaled_bf16(v, 0.5), e4m3, "{v:#x}");
        assert_eq!(e2m1_of_scaled_bf16(v, 0.5), e2m1, "{v:#x}");
    }
    let mut rng = Rng::new(9);
    for _ in 0..10_000 {
        let v = rng.next_u64() as u16;
        if v & 0x7fff > 0x7f80 {
            continue;
        }
        let inv = f32::from_bits(((100 + rng.below(60)) as u32) << 23);
        let f = f32::from_bits(u32::from(v) << 16) * inv;
        assert_eq!(e4m3_of_scaled_bf16(v, inv), e4m3_rne(f.to_bits()));
        assert_eq!(e2m1_of_scaled_bf16(v, inv), e2m1_rne(f.to_bits()));
    }
}

#[test]
fn bytes_per_token_are_the_published_ones() {
    let b: Vec<u64> = ALL.iter().map(|f| f.format().bytes_per_token()).collect();
    assert_eq!(b, [640, 1024, 584, 584, 528, 288]);
    for f in ALL {
        assert_eq!(RowFormatId::from_name(f.format().name), Ok(f));
    }
    assert!(matches!(RowFormatId::from_name("fp9"), Err(FormatError::Unknown { .. })));
}

#[test]
fn paged_offsets_follow_flashmla_v4() {
    let p = &RowFormatId::FlashMlaV4.format().planes[0];
    // Page 1 starts at 64 × 584; its row 3's data at +3 × 576, its scales after 64 × 576.
    assert_eq!(p.byte_offset(67, 0), Some(37_376 + 3 * 576));
    assert_eq!(p.byte_offset(67, 1), Some(37_376 + 36_864 + 3 * 8));
    // Whole pages are one span; a partial page two.
    assert_eq!(p.row_spans(64, 128), Some(vec![(37_376, 2 * 37_376)]));
    assert_eq!(p.row_spans(2, 3), Some(vec![(2 * 576, 3 * 576), (36_864 + 16, 24)]));
    let u = &RowFormatId::FlashMlaV41.format().planes[0];
    assert_eq!(u.row_spans(5, 70), Some(vec![(5 * 528, 70 * 528)]));
    // Pages of 2 (1,168 B): row 67 is page 33's second row, its scales after 2 × 576.
    let p2 = &RowFormatId::FlashMlaV4P2.format().planes[0];
    assert_eq!(p2.byte_offset(67, 0), Some(33 * 1_168 + 576));
    assert_eq!(p2.byte_offset(67, 1), Some(33 * 1_168 + 1_152 + 8));
    assert_eq!(p2.row_spans(4, 6), Some(vec![(4 * 584, 6 * 584)]));
    // Rows 3 and 4: row 3's data, its scales abutting row 4's data (page 2), row 4's scales.
    assert_eq!(
        p2.row_spans(3, 2),
        Some(vec![(1_168 + 576, 576), (1_168 + 1_160, 8 + 576), (2 * 1_168 + 1_152, 8)])
    );
}

#[test]
fn pack_place_fetch_unpack_round_trip_within_the_format_error() {
    let mut rng = Rng::new(11);
    for f in ALL {
        let fmt = f.format();
        let mut planes: Vec<Vec<u8>> =
            fmt.planes.iter().map(|p| vec![0xeeu8; (130 * p.row_bytes()) as usize]).collect();
        let kv = random_row(&mut rng);
        let packed = fmt.pack(&kv).unwrap();
        let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
        fmt.place(69, &packed, &mut views).unwrap();
        let views: Vec<&[u8]> = planes.iter().map(|v| v.as_slice()).collect();
        let back = fmt.fetch(69, &views).unwrap();
        assert_eq!(back, packed, "{}", fmt.name);
        let refs: Vec<&[u8]> = back.iter().map(|v| v.as_slice()).collect();
        let vals = fmt.unpack(&refs).unwrap();
        for (i, (&v, &x)) in vals.iter().zip(&kv).enumerate() {
            let x = f32::from_bits(u32::from(x) << 16);
            // Relative to the value's group amax: e4m3 has 3 mantissa bits, e2m1 1.
            let rel = match fmt.name {
                "bf16" => 0.0,
                "flashmla-v41-fp4" => 0.26,
                _ => 0.0625,
            };
            let group_amax = 2f32.powi((i / 32) as i32 % 9 - 4);
            assert!((v - x).abs() <= rel * group_amax + 1e-30, "{} value {i}: {v} vs {x}", fmt.name);
        }
        // Only the row's own bytes changed.
        let touched: usize = planes.iter().map(|p| p.iter().filter(|&&b| b != 0xee).count()).sum();
        assert!(touched as u64 <= fmt.bytes_per_token());
    }
}

#[test]
fn flashmla_scale_floor_is_quant_py_rule() {
    // 2^ceil(log2(max(amax / 448, 1e-4))): tiny or zero rows get 2^-13 (byte 114).
    let kv = vec![0u16; KV_ROW_VALUES];
    let v4 = RowFormatId::FlashMlaV4.format().pack(&kv).unwrap();
    assert_eq!(&v4[0][576..583], &[114u8; 7]);
    let atom = RowFormatId::AtomFp8.format().pack(&kv).unwrap();
    assert_eq!(&atom[0][448..462], &[0u8; 14]);
    // amax exactly 448 × 2^k takes scale 2^k; one bf16 step above takes 2^(k+1).
    let mut kv = vec![0u16; KV_ROW_VALUES];
    kv[0] = (448f32.to_bits() >> 16) as u16;
    assert_eq!(RowFormatId::FlashMlaV4.format().pack(&kv).unwrap()[0][576], 127);
    kv[0] += 1;
    assert_eq!(RowFormatId::FlashMlaV4.format().pack(&kv).unwrap()[0][576], 128);
}

#[test]
fn e4m3fnuz_follows_aiters_rules() {
    // Every finite code round-trips; its value is half the e4m3fn value of the same byte.
    for b in 0..=255u8 {
        let v = e4m3fnuz_value(b);
        if b == 0x80 {
            assert!(v.is_nan());
            continue;
        }
        assert_eq!(e4m3fnuz_rne(v.to_bits()), b, "{b:#04x} = {v}");
        if b & 0x7f != 0x7f {
            assert_eq!(v, e4m3_value(b) / 2.0, "{b:#04x}");
        }
    }
    assert_eq!(e4m3fnuz_value(0x7f), 240.0);
    // Midpoints go to the even code, one ulp either side to the nearer.
    for b in 0..0x7eu8 {
        let (lo, hi) = (e4m3fnuz_value(b), e4m3fnuz_value(b + 1));
        let mid = (lo + hi) / 2.0;
        let even = if b % 2 == 0 { b } else { b + 1 };
        assert_eq!(e4m3fnuz_rne(mid.to_bits()), even, "midpoint {mid}");
        assert_eq!(e4m3fnuz_rne(mid.to_bits() + 1), b + 1, "above {mid}");
        assert_eq!(e4m3fnuz_rne(mid.to_bits() - 1), b, "below {mid}");
        assert_eq!(e4m3fnuz_rne((-mid).to_bits()), if even == 0 { 0 } else { 0x80 | even }, "-{mid}");
    }
    // No negative zero: -0.0 and negatives rounding to zero are 0x00; NaN and infinities
    // are the one NaN; past 240 clips.
    assert_eq!(e4m3fnuz_rne((-0.0f32).to_bits()), 0);
    assert_eq!(e4m3fnuz_rne((-1e-9f32).to_bits()), 0);
    assert_eq!(e4m3fnuz_rne((-2f32.powi(-12)).to_bits()), 0);
    assert_eq!(e4m3fnuz_rne((-2f32.powi(-10)).to_bits()), 0x81);
    for x in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(e4m3fnuz_rne(x.to_bits()), 0x80, "{x}");
    }
    for (x, b) in [(240.0f32, 0x7f), (247.9, 0x7f), (1e30, 0x7f), (-300.0, 0xff), (232.0, 0x7e)] {
        assert_eq!(e4m3fnuz_rne(x.to_bits()), b, "{x}");
    }
}

#[test]
fn the_power_of_two_scale_is_the_least_that_fits_each_max() {
    for max in [E4M3FN_MAX, E4M3FNUZ_MAX, 0x40c0_0000] {
        let m = f64::from(f32::from_bits(max));
        for amax in [1e-4f32, 1.0, 239.9, 240.0, 240.1, 448.0, 449.0, 6.0, 7.0, 3e38, 1e-30] {
            let b = e8m0_fitting(amax.to_bits(), max);
            let scale = (f64::from(b) - 127.0).exp2();
            assert!(f64::from(amax) / scale <= m, "{amax} / 2^{} > {m}", i32::from(b) - 127);
            assert!(b == 1 || f64::from(amax) / (scale / 2.0) > m, "{amax}: {b} not the least");
        }
    }
    assert_eq!(e8m0_fitting(0, E4M3FNUZ_MAX), 0);
}

#[test]
fn the_key_formats_place_values_as_their_readers_read_them() {
    // Row-major: r × 128 + d; preshuffled: 16×16 tiles, 16 rows a group.
    assert_eq!(FP8_KEYS.value_offset(64, 5, 17), Some(5 * 128 + 17));
    assert_eq!(ATOM_FP8_FNUZ_KEYS.value_offset(64, 17, 35), Some(2048 + 2 * 256 + 16 + 3));
    assert_eq!(ATOM_FP8_KEYS.scale_offset(64, 3), Some(64 * 128 + 12));
    assert_eq!(ATOM_FP8_KEYS.value_offset(40, 0, 0), None); // not whole 16-row groups
    assert_eq!(ATOM_FP8_KEYS.value_offset(64, 64, 0), None);
    // An all-zero row takes the 1e-4 floor: 2^-21 at 240, 2^-22 at 448.
    let mut q = [0xaau8; 128];
    assert_eq!(f32::from_bits(ATOM_FP8_FNUZ_KEYS.pack(&[0x8000; 128], &mut q).unwrap()), 2f32.powi(-21));
    assert!(q.iter().all(|&b| b == 0), "-0.0 is 0x00 in e4m3fnuz");
    assert_eq!(f32::from_bits(ATOM_FP8_KEYS.pack(&[0; 128], &mut q).unwrap()), 2f32.powi(-22));
}
