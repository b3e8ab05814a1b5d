//! The restricted unpickler alone (most of a `.pt` file's attack surface).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_formats::torch::unpickle::unpickle(data);
    let _ = ckpt_formats::torch::zip::parse(data);
});
