use super::GeometryError;

/// Merge ascending `(start, count)` runs, joining a run that starts exactly where the
/// previous one ends. Negative values and runs that start before the previous end are
/// errors; zero-count runs are legal.
pub fn merge_abutting(runs: &[(i64, i64)]) -> Result<Vec<(i64, i64)>, GeometryError> {
    let mut out: Vec<(i64, i64)> = Vec::with_capacity(runs.len());
    for &(start, count) in runs {
        if start < 0 || count < 0 {
            return Err(GeometryError::RunNegative { start, count });
        }
        if let Some(last) = out.last_mut() {
            let prev_end = last.0.checked_add(last.1).ok_or(GeometryError::Overflow { what: "run end" })?;
            if start < prev_end {
                return Err(GeometryError::RunOverlap { start, count, prev_end });
            }
            if start == prev_end {
                last.1 = last.1.checked_add(count).ok_or(GeometryError::Overflow { what: "run length" })?;
                continue;
            }
        }
        out.push((start, count));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_examples() {
        assert_eq!(merge_abutting(&[(0, 4), (4, 4), (12, 4)]).unwrap(), vec![(0, 8), (12, 4)]);
        assert_eq!(merge_abutting(&[]).unwrap(), vec![]);
        assert!(matches!(
            merge_abutting(&[(0, 400), (256, 64), (320, 64)]),
            Err(GeometryError::RunOverlap { start: 256, .. })
        ));
        assert!(matches!(merge_abutting(&[(256, 64), (0, 64)]), Err(GeometryError::RunOverlap { .. })));
        assert_eq!(merge_abutting(&[(5, 0), (5, 3)]).unwrap(), vec![(5, 3)]);
        assert!(matches!(merge_abutting(&[(-1, 3)]), Err(GeometryError::RunNegative { .. })));
        assert!(matches!(merge_abutting(&[(1, -3)]), Err(GeometryError::RunNegative { .. })));
    }
}
