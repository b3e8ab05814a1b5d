//! A plain dump of a `VarStore`'s weights, for bitwise comparison of two runs.
//!
//! Layout: for each variable in name order, a line `name dtype shape nbytes\n`
//! followed by the raw little-endian bytes.

use std::io::Write;
use std::path::Path;

use ckpt_core::torch::{dtype_of, tch};

/// The dump of every variable of `vs`.
pub fn dump(vs: &tch::nn::VarStore) -> Vec<u8> {
    let mut vars: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::new();
    for (name, t) in vars {
        let t = t.to_device(tch::Device::Cpu).contiguous();
        let kind = t.kind();
        let mut bytes = vec![0u8; t.numel() * kind.elt_size_in_bytes()];
        t.copy_data_u8(&mut bytes, t.numel());
        let dtype = dtype_of(kind).map(|d| d.to_string()).unwrap_or_default();
        let _ = writeln!(out, "{name} {dtype} {:?} {}", t.size(), bytes.len());
        out.extend_from_slice(&bytes);
    }
    out
}

/// Write the dump to `path` atomically (a temporary file renamed into place).
pub fn write(vs: &tch::nn::VarStore, path: &Path) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&dump(vs))?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}
