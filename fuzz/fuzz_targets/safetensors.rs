//! The safetensors reader (header parse, offsets, dtypes, `__metadata__` JSON) and
//! the sharded-checkpoint index parser.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = ckpt_formats::safetensors::read_file(&bytes::Bytes::copy_from_slice(data));
    let _ = ckpt_formats::safetensors::index::Index::parse(data);
});
