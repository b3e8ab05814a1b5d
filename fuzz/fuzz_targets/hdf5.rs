//! The pure half of the HDF5 importer: what it decides from the datatypes,
//! shapes, attributes and names libhdf5 reports, and the writer's splice plan.
//!
//! libhdf5's own parser (C) is not fuzzed here: a crash found in it is a
//! libhdf5 bug that ckpt cannot fix, and it runs uninstrumented. What ckpt adds
//! on top, and what must never panic or accept an inconsistent tensor, is this.
#![no_main]

use ckpt_core::DType;
use ckpt_formats::hdf5::dtypes::{classify, resolve, FloatBits, TypeDesc};
use ckpt_formats::hdf5::names::place_all;
use ckpt_formats::hdf5::write::splice;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let (b, rest) = self
            .0
            .split_first()
            .map(|(b, r)| (*b, r))
            .unwrap_or((0, &[]));
        self.0 = rest;
        b
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, _| a << 8 | u64::from(self.byte()))
    }
    fn str(&mut self) -> String {
        let n = usize::from(self.byte() % 8);
        (0..n)
            .map(|_| char::from(b"ab./%\0TRUEFALSEri"[usize::from(self.byte()) % 17]))
            .collect()
    }
    fn desc(&mut self, depth: usize) -> TypeDesc {
        match self.byte() % 5 {
            0 => TypeDesc::Int {
                size: usize::from(self.byte() % 10),
                signed: self.byte() & 1 == 1,
                little_endian: self.byte() & 1 == 1,
            },
            1 => {
                let mut f = || usize::from(self.byte() % 70);
                let bits = FloatBits {
                    size: f() % 9,
                    spos: f(),
                    epos: f(),
                    esize: f(),
                    mpos: f(),
                    msize: f(),
                    ebias: 0,
                };
                TypeDesc::Float {
                    bits: FloatBits {
                        ebias: self.u64() % 2048,
                        ..bits
                    },
                    little_endian: true,
                }
            }
            2 if depth < 3 => {
                let base = Box::new(self.desc(depth + 1));
                let n = self.byte() % 4;
                let members = (0..n)
                    .map(|_| (self.str(), i64::from(self.byte() as i8)))
                    .collect();
                TypeDesc::Enum { base, members }
            }
            3 if depth < 3 => {
                let size = usize::from(self.byte() % 20);
                let n = self.byte() % 4;
                let members = (0..n)
                    .map(|_| {
                        (
                            self.str(),
                            usize::from(self.byte() % 20),
                            self.desc(depth + 1),
                        )
                    })
                    .collect();
                TypeDesc::Compound { size, members }
            }
            _ => TypeDesc::Other(self.str()),
        }
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let desc = inp.desc(0);
    let shape: Vec<u64> = (0..inp.byte() % 4).map(|_| inp.u64() % 64).collect();
    let ckpt_dtype = (inp.byte() & 1 == 1).then(|| {
        DType::ALL[usize::from(inp.byte()) % DType::ALL.len()]
            .name()
            .to_owned()
    });
    let ckpt_shape: Option<Vec<u64>> =
        (inp.byte() & 1 == 1).then(|| (0..inp.byte() % 3).map(|_| inp.u64()).collect());
    if let Ok(native) = classify(&desc) {
        if let Ok((d, logical)) =
            resolve(native, &shape, ckpt_dtype.as_deref(), ckpt_shape.as_deref())
        {
            // Whatever is accepted describes whole bytes of a consistent tensor.
            let numel = logical.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
            assert!(
                numel.is_some_and(|n| d.byte_len(n).is_ok()),
                "{d} {logical:?}"
            );
        }
    }
    let names: Vec<String> = (0..inp.byte() % 6).map(|_| inp.str()).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    if let Ok(places) = place_all(&refs) {
        let mut paths: Vec<String> = places.iter().map(|p| p.path()).collect();
        paths.sort();
        paths.dedup();
        assert_eq!(paths.len(), names.len());
    }
    let file_len = inp.u64() % 4096;
    let ranges: Vec<(u64, u64)> = (0..inp.byte() % 6)
        .map(|_| (inp.u64() % 5000, inp.u64() % 300))
        .collect();
    if let Ok(pieces) = splice(file_len, &ranges) {
        // The pieces tile the file exactly.
        let total: u64 = pieces
            .iter()
            .map(|p| match p {
                ckpt_formats::hdf5::write::Piece::File(a, b) => b - a,
                ckpt_formats::hdf5::write::Piece::Tensor(i) => ranges[*i].1,
            })
            .sum();
        assert_eq!(total, file_len);
    }
});
