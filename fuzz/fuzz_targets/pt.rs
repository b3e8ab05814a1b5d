//! A whole `.pt` file: zip directory, records, CRCs, pickle, tensor views.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_formats::torch::read_pt(&bytes::Bytes::copy_from_slice(data));
});
