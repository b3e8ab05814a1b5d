//! The manifest decoder must return a value or an error for any input, never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_core::Manifest::decode(data, "fuzz");
});
