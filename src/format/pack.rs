//! A row format's host packer and unpacker, and the placing of a packed row into planes
//! through [`PlaneFormat::byte_offset`]: the reference every backend's bytes are held to.

use super::codec::{
    amax_of, e2m1_of_scaled_bf16, e2m1_value, e4m3_of_scaled_bf16, e4m3_rne, e4m3_value, e8m0_of_amax,
    e8m0_of_amax_e2m1, e8m0_value,
};
use super::{Elem, FormatError, Place, PlaneFormat, RowFormat, ScaleEnc, KV_ROW_VALUES};

impl RowFormat {
    /// Bytes one token's row takes over every plane.
    pub fn bytes_per_token(&self) -> u64 {
        self.planes.iter().map(PlaneFormat::row_bytes).sum()
    }
    /// Row bytes of each plane, in plane order.
    pub fn plane_widths(&self) -> Vec<u64> {
        self.planes.iter().map(PlaneFormat::row_bytes).collect()
    }
    /// Whether any plane is paged (its rows' bytes are not contiguous).
    pub fn is_paged(&self) -> bool {
        self.planes.iter().any(|p| p.page_rows > 1)
    }

    fn byte_in_row(&self, p: Place) -> usize {
        let plane = &self.planes[p.plane];
        plane.regions[..p.region].iter().sum::<u64>() as usize + p.offset
    }

    /// One token's 512 bf16 values (native-order bits) as its row in each plane, regions in
    /// order (de-paged: [`PlaneFormat::byte_offset`] places each region). Bytes no segment
    /// names (padding) are zero.
    pub fn pack(&self, kv: &[u16]) -> Result<Vec<Vec<u8>>, FormatError> {
        if kv.len() != KV_ROW_VALUES {
            return Err(FormatError::RowLength { got: kv.len(), want: KV_ROW_VALUES });
        }
        let mut out: Vec<Vec<u8>> = self.planes.iter().map(|p| vec![0u8; p.row_bytes() as usize]).collect();
        for seg in self.segments {
            let vals = &kv[seg.first..seg.first + seg.count];
            let data = self.byte_in_row(seg.data);
            let group = seg.scale.map_or(seg.count, |s| s.group);
            for (g, x) in vals.chunks(group).enumerate() {
                // inv: 1 / scale, the factor a value is multiplied by before rounding.
                let inv = match seg.scale {
                    None => 1.0,
                    Some(s) => {
                        let (byte, inv) = match s.enc {
                            ScaleEnc::E8m0 { amax_floor } => {
                                let a = amax_of(x).max(amax_floor);
                                let b = match seg.elem {
                                    Elem::E2m1 => e8m0_of_amax_e2m1(a),
                                    _ => e8m0_of_amax(a),
                                };
                                // 1 / scale as the kernels form it, 2^(127 - B) from its bits
                                // (0 for B = 0, and for B = 254, an infinite amax's).
                                let inv =
                                    if b == 0 { 0.0 } else { f32::from_bits((254 - u32::from(b)) << 23) };
                                (b, inv)
                            }
                            ScaleEnc::E4m3 => {
                                let max = if seg.elem == Elem::E2m1 { 6.0 } else { 448.0 };
                                let b = e4m3_rne((f32::from_bits(amax_of(x)) / max).to_bits());
                                let scale = e4m3_value(b);
                                (b, if scale > 0.0 && scale.is_finite() { 1.0 / scale } else { 0.0 })
                            }
                        };
                        let at = self.byte_in_row(s.place) + g * s.copies;
                        out[s.place.plane][at..at + s.copies].fill(byte);
                        inv
                    }
                };
                for (i, &v) in x.iter().enumerate() {
                    let k = g * group + i; // value index inside the segment
                    let row = &mut out[seg.data.plane];
                    match seg.elem {
                        Elem::Bf16 => row[data + 2 * k..data + 2 * k + 2].copy_from_slice(&v.to_ne_bytes()),
                        // A power-of-two inverse is exact; an e4m3 scale's is rounded once.
                        Elem::E4m3 => row[data + k] = e4m3_of_scaled_bf16(v, inv),
                        Elem::E2m1 => {
                            let n = e2m1_of_scaled_bf16(v, inv);
                            row[data + k / 2] |= if k % 2 == 0 { n } else { n << 4 };
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// The 512 values a row holds (f32; what an attention kernel dequantises to), from each
    /// plane's row as [`RowFormat::pack`] returns it.
    pub fn unpack(&self, rows: &[&[u8]]) -> Result<Vec<f32>, FormatError> {
        for (plane, p) in self.planes.iter().enumerate() {
            let got = rows.get(plane).map_or(0, |r| r.len());
            if got != p.row_bytes() as usize {
                return Err(FormatError::PlaneLength {
                    format: self.name,
                    plane,
                    got,
                    want: p.row_bytes() as usize,
                });
            }
        }
        let mut out = vec![0f32; KV_ROW_VALUES];
        for seg in self.segments {
            let data = self.byte_in_row(seg.data);
            let row = rows[seg.data.plane];
            for k in 0..seg.count {
                let scale = seg.scale.map_or(1.0, |s| {
                    let b = rows[s.place.plane][self.byte_in_row(s.place) + (k / s.group) * s.copies];
                    match s.enc {
                        ScaleEnc::E8m0 { .. } => e8m0_value(b),
                        ScaleEnc::E4m3 => e4m3_value(b),
                    }
                });
                let v = match seg.elem {
                    Elem::Bf16 => f32::from_bits(
                        u32::from(u16::from_ne_bytes([row[data + 2 * k], row[data + 2 * k + 1]])) << 16,
                    ),
                    Elem::E4m3 => e4m3_value(row[data + k]),
                    Elem::E2m1 => e2m1_value(row[data + k / 2] >> (4 * (k % 2))),
                };
                out[seg.first + k] = v * scale;
            }
        }
        Ok(out)
    }

    /// Writes the packed row (`pack`'s output) as row `row` of the planes (`planes[i]` is plane
    /// i from its row 0), through [`PlaneFormat::byte_offset`].
    /// `None` (nothing written) for a row outside the planes and for images that are not
    /// one row of each of the format's planes.
    pub fn place(&self, row: u64, packed: &[Vec<u8>], planes: &mut [&mut [u8]]) -> Option<()> {
        let n = self.planes.len();
        if packed.len() != n
            || planes.len() != n
            || self.planes.iter().zip(packed).any(|(p, img)| img.len() as u64 != p.row_bytes())
        {
            return None;
        }
        // Every destination checked before the first byte moves: a refused place writes nothing.
        let mut spans = Vec::new();
        for (i, p) in self.planes.iter().enumerate() {
            for (k, &w) in p.regions.iter().enumerate() {
                let off = usize::try_from(p.byte_offset(row, k)?).ok()?;
                let end = off.checked_add(usize::try_from(w).ok()?)?;
                planes[i].get(off..end)?;
                spans.push((i, off, end));
            }
        }
        let mut at = vec![0usize; n];
        for (i, off, end) in spans {
            planes[i][off..end].copy_from_slice(&packed[i][at[i]..at[i] + (end - off)]);
            at[i] += end - off;
        }
        Some(())
    }

    /// Tokens `kv` (`n × 512` bf16 bits, token after token) as rows `0..n` of fresh planes of
    /// `n` rows rounded up to whole kernel pages (zero elsewhere): what an attention kernel
    /// reads, built by the description alone (tests, and engines checking a format).
    pub fn pack_planes(&self, kv: &[u16]) -> Result<Vec<Vec<u8>>, FormatError> {
        if kv.len() % KV_ROW_VALUES != 0 {
            return Err(FormatError::RowLength { got: kv.len() % KV_ROW_VALUES, want: KV_ROW_VALUES });
        }
        let n = (kv.len() / KV_ROW_VALUES) as u64;
        let rows = n.div_ceil(self.kernel_page_rows) * self.kernel_page_rows;
        let mut planes: Vec<Vec<u8>> =
            self.planes.iter().map(|p| vec![0u8; (rows * p.row_bytes()) as usize]).collect();
        for (t, x) in kv.chunks_exact(KV_ROW_VALUES).enumerate() {
            let packed = self.pack(x)?;
            let mut views: Vec<&mut [u8]> = planes.iter_mut().map(|v| v.as_mut_slice()).collect();
            // In range by construction: the planes hold `rows >= n` rows.
            self.place(t as u64, &packed, &mut views).expect("rows inside the planes");
        }
        Ok(planes)
    }

    /// Reads row `row` of the planes back as `pack`'s per-plane images.
    pub fn fetch(&self, row: u64, planes: &[&[u8]]) -> Option<Vec<Vec<u8>>> {
        self.planes
            .iter()
            .zip(planes)
            .map(|(p, src)| {
                let mut img = Vec::with_capacity(p.row_bytes() as usize);
                for (k, &w) in p.regions.iter().enumerate() {
                    let off = usize::try_from(p.byte_offset(row, k)?).ok()?;
                    img.extend_from_slice(src.get(off..off + w as usize)?);
                }
                Some(img)
            })
            .collect()
    }
}
