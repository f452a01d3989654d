//! Checked integer arithmetic for sizes, offsets and rows that come from callers: overflow is
//! a typed error naming the quantity, never a wrap or a panic. One helper for the whole crate;
//! each module's error type has an `Overflow { what }` variant and converts from [`Overflow`],
//! so `mul(a, b, "plane bytes")?` reads the same everywhere.

/// An arithmetic overflow in computing `what`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Overflow {
    /// The quantity being computed.
    pub what: &'static str,
}

/// The integer types the helpers take.
pub(crate) trait CheckedInt: Copy {
    /// `self + rhs`, `None` on overflow.
    fn add(self, rhs: Self) -> Option<Self>;
    /// `self * rhs`, `None` on overflow.
    fn mul(self, rhs: Self) -> Option<Self>;
    /// `self - rhs`, `None` on overflow.
    fn sub(self, rhs: Self) -> Option<Self>;
}

macro_rules! checked_int {
    ($($t:ty),*) => {$(
        impl CheckedInt for $t {
            fn add(self, rhs: Self) -> Option<Self> {
                self.checked_add(rhs)
            }
            fn mul(self, rhs: Self) -> Option<Self> {
                self.checked_mul(rhs)
            }
            fn sub(self, rhs: Self) -> Option<Self> {
                self.checked_sub(rhs)
            }
        }
    )*};
}
checked_int!(u64, i64, usize);

/// `a + b`, or [`Overflow`] naming `what`.
pub(crate) fn add<T: CheckedInt>(a: T, b: T, what: &'static str) -> Result<T, Overflow> {
    a.add(b).ok_or(Overflow { what })
}

/// `a * b`, or [`Overflow`] naming `what`.
pub(crate) fn mul<T: CheckedInt>(a: T, b: T, what: &'static str) -> Result<T, Overflow> {
    a.mul(b).ok_or(Overflow { what })
}

/// `a - b`, or [`Overflow`] naming `what` (for unsigned types: `b > a`).
pub(crate) fn sub<T: CheckedInt>(a: T, b: T, what: &'static str) -> Result<T, Overflow> {
    a.sub(b).ok_or(Overflow { what })
}

/// The greatest common divisor of `a` and `b` (Euclid; `gcd(a, 0) = a`), for the alignments
/// and periods the geometry, the arena and the handoff combine. Never overflows: every step's
/// remainder is smaller than its divisor. Callers pass non-negative values.
pub(crate) fn gcd<T: Copy + PartialEq + Default + std::ops::Rem<Output = T>>(a: T, b: T) -> T {
    if b == T::default() {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `From<Overflow>` for an error type with an `Overflow { what }` variant.
macro_rules! overflow_into {
    ($($e:ty),*) => {$(
        impl From<$crate::checked::Overflow> for $e {
            fn from(o: $crate::checked::Overflow) -> Self {
                Self::Overflow { what: o.what }
            }
        }
    )*};
}
pub(crate) use overflow_into;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_names_the_quantity() {
        assert_eq!(mul(u64::MAX, 2, "plane bytes"), Err(Overflow { what: "plane bytes" }));
        assert_eq!(add(i64::MAX, 1, "row"), Err(Overflow { what: "row" }));
        assert_eq!(sub(1u64, 2, "rows left"), Err(Overflow { what: "rows left" }));
        assert_eq!(sub(i64::MIN, 1, "offset"), Err(Overflow { what: "offset" }));
        assert_eq!(mul(3i64, -4, "x"), Ok(-12));
        assert_eq!(add(usize::MAX - 1, 1, "x"), Ok(usize::MAX));
    }

    #[test]
    fn gcd_against_a_search() {
        // Against the largest common divisor found by trying every candidate.
        for a in 0u64..60 {
            for b in 0u64..60 {
                let want = (1..=a.max(b)).rev().find(|d| a % d == 0 && b % d == 0).unwrap_or(0);
                assert_eq!(gcd(a, b), want, "gcd({a}, {b})");
                assert_eq!(gcd(a as i64, b as i64), want as i64, "gcd({a}, {b}) in i64");
            }
        }
        assert_eq!(gcd(u64::MAX, u64::MAX - 1), 1);
        assert_eq!(gcd(584u64 * 32, 256), 256);
    }
}
