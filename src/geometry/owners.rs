//! Shared compressors (V4.1): which layer's compressed rows each layer reads, which index
//! buffer slot each compressed class takes, and how many compressed groups a token sees.
//! Pure functions of the ratio list; `docs/v41.md` says where each rule comes from.

use super::{envelope_order, GeometryError, CSA_RATIO, HCA_RATIO};

/// Every layer's owner: the layer whose compressed rows it reads.
///
/// Window-only and absent layers have none; with no sources (or an empty list) every
/// compressed layer owns its rows (V4). Otherwise a layer's owner is the largest source at or
/// before it, which must exist and be in the layer's class. `sources` must ascend without
/// repeats and name compressed layers only.
pub fn resolve_owners(ratios: &[i32], sources: &[usize]) -> Result<Vec<Option<usize>>, GeometryError> {
    if sources.windows(2).any(|w| w[0] >= w[1]) {
        return Err(GeometryError::SourcesNotSorted { sources: sources.to_vec() });
    }
    for &s in sources {
        if ratios.get(s).is_none_or(|&r| r <= 0) {
            return Err(GeometryError::BadSource { layer: s, num_layers: ratios.len() });
        }
    }
    ratios
        .iter()
        .enumerate()
        .map(|(layer, &ratio)| {
            if ratio <= 0 {
                return Ok(None);
            }
            if sources.is_empty() {
                return Ok(Some(layer));
            }
            let owner = match sources.partition_point(|&s| s <= layer) {
                0 => return Err(GeometryError::NoSourceBefore { layer }),
                n => sources[n - 1],
            };
            let owner_ratio = ratios[owner];
            if owner_ratio != ratio {
                return Err(GeometryError::OwnerClassDiffers { layer, ratio, owner, owner_ratio });
            }
            Ok(Some(owner))
        })
        .collect()
}

/// The two index-buffer slots as `(fine, coarse)` ratios: the smaller compressed ratio
/// takes the fine ("CSA") buffers, the larger the coarse ("HCA") ones. A lone ratio 128
/// takes the coarse slot, any other lone ratio the fine one; a slot left over keeps V4's
/// value. More than two compressed classes cannot be given buffers.
pub fn index_slots(ratios: &[i32]) -> Result<(i32, i32), GeometryError> {
    let order = envelope_order(ratios);
    match order[..] {
        [] => Ok((CSA_RATIO, HCA_RATIO)),
        [HCA_RATIO] => Ok((CSA_RATIO, HCA_RATIO)),
        [r] => Ok((r, HCA_RATIO)),
        [coarse, fine] => Ok((fine, coarse)),
        _ => Err(GeometryError::TooManyIndexClasses { count: order.len(), ratios: order }),
    }
}

/// Compressed groups of ratio `ratio` a token at absolute position `pos` sees:
/// `(pos + 1) / ratio`, its own position only — never the sequence's length, so that one
/// step's earlier tokens do not see groups its later tokens close. `pos >= 0`, `ratio >= 1`.
#[inline]
pub const fn visible_groups(pos: i64, ratio: i64) -> i64 {
    (pos + 1) / ratio
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v41() -> Vec<i32> {
        let mut r = vec![0, 0];
        r.extend([2; 18]);
        r.extend([1; 20]);
        r
    }

    #[test]
    fn the_v41_kv_and_index_maps() {
        let kv = resolve_owners(&v41(), &[2, 8, 14, 20]).unwrap();
        assert_eq!(kv.len(), 40);
        for (l, &got) in kv.iter().enumerate() {
            let want = match l {
                0 | 1 => None,
                2..=7 => Some(2),
                8..=13 => Some(8),
                14..=19 => Some(14),
                _ => Some(20),
            };
            assert_eq!(got, want, "layer {l}");
        }
        let ix = resolve_owners(&v41(), &[2, 8, 14, 20, 24, 28, 32, 36]).unwrap();
        assert_eq!(ix.len(), 40);
        for (l, &got) in ix.iter().enumerate().skip(20) {
            assert_eq!(got, Some(20 + (l - 20) / 4 * 4), "layer {l}");
        }
    }

    #[test]
    fn sources_across_classes_or_missing_are_refused() {
        assert_eq!(
            resolve_owners(&v41(), &[2, 8, 14, 19]),
            Err(GeometryError::OwnerClassDiffers { layer: 20, ratio: 1, owner: 19, owner_ratio: 2 })
        );
        assert_eq!(resolve_owners(&v41(), &[8, 14, 20]), Err(GeometryError::NoSourceBefore { layer: 2 }));
        assert!(matches!(resolve_owners(&v41(), &[8, 2]), Err(GeometryError::SourcesNotSorted { .. })));
        assert!(matches!(resolve_owners(&v41(), &[2, 2]), Err(GeometryError::SourcesNotSorted { .. })));
        assert_eq!(resolve_owners(&v41(), &[0]), Err(GeometryError::BadSource { layer: 0, num_layers: 40 }));
        assert_eq!(
            resolve_owners(&v41(), &[40]),
            Err(GeometryError::BadSource { layer: 40, num_layers: 40 })
        );
        // No list: every compressed layer is its own owner.
        assert_eq!(resolve_owners(&[0, 4, 128], &[]).unwrap(), vec![None, Some(1), Some(2)]);
    }

    #[test]
    fn index_slots_follow_the_reference() {
        assert_eq!(index_slots(&[0, 4, 128]), Ok((4, 128)));
        assert_eq!(index_slots(&v41()), Ok((1, 2)));
        assert_eq!(index_slots(&[0, 4]), Ok((4, 128)));
        assert_eq!(index_slots(&[0, 128]), Ok((4, 128)));
        assert_eq!(index_slots(&[0, 256]), Ok((256, 128)));
        assert_eq!(index_slots(&[0, 2]), Ok((2, 128)));
        assert_eq!(index_slots(&[0]), Ok((4, 128)));
        assert_eq!(
            index_slots(&[0, 1, 2, 4]),
            Err(GeometryError::TooManyIndexClasses { count: 3, ratios: vec![4, 2, 1] })
        );
    }

    #[test]
    fn visibility_is_per_position() {
        let r2: Vec<i64> = [0, 1, 2, 3, 7].iter().map(|&p| visible_groups(p, 2)).collect();
        assert_eq!(r2, vec![0, 1, 1, 2, 4]);
        for p in 0..300 {
            assert_eq!(visible_groups(p, 1), p + 1);
        }
        // Where p < ctx the per-sequence bound min((p+1)/r, ctx/r) is redundant.
        for r in [1, 2, 4, 128] {
            for ctx in 1..=600 {
                for p in 0..ctx {
                    assert_eq!(visible_groups(p, r), visible_groups(p, r).min(ctx / r));
                }
            }
        }
    }
}
