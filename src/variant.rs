//! [`VariantName`]: the name of an error's variant, as the bindings and `v4pool ... --json`
//! report it. Every error type of the library implements it by hand (one match arm per
//! variant), so no caller reads an error's `Debug` text or matches variant-name strings.

/// The name of the variant an error value is; a variant that wraps another module's error
/// reports the wrapped one's (the innermost), so a geometry error inside a pool error reads
/// as the geometry's variant.
pub trait VariantName {
    /// The variant's name (innermost for wrapped errors).
    fn variant_name(&self) -> &'static str;

    /// Whether the innermost error is the device's failure (a driver absent or failing, out
    /// of memory, a kernel missing or failing to compile or launch) rather than a refusal of
    /// the caller's input: the C ABI's `V4POOL_BACKEND` status. Wrappers delegate; the
    /// default is a refusal.
    fn is_device_failure(&self) -> bool {
        false
    }
}

impl<T: VariantName + ?Sized> VariantName for Box<T> {
    fn variant_name(&self) -> &'static str {
        (**self).variant_name()
    }
    fn is_device_failure(&self) -> bool {
        (**self).is_device_failure()
    }
}
