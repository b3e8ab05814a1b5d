//! The native chunk decoder, against the hash of the input's tail (so both the
//! mismatch and the match paths are reached).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let hash = blake3::hash(data.get(16..).unwrap_or(&[]))
        .to_hex()
        .to_string();
    let _ =
        ckpt_formats::native::chunk::decode(bytes::Bytes::copy_from_slice(data), &hash, 1 << 20);
});
