//! The machine's own limits, measured in the same run as the experiments so every
//! figure can be given as a ratio to them.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use ckpt_core::State;

/// Seconds to copy every tensor of `state` into warm (already touched) buffers on
/// one thread: the floor for a blocking snapshot.
pub fn memcpy_secs(state: &State) -> f64 {
    let mut dst: Vec<Vec<u8>> = state
        .tensors
        .iter()
        .map(|t| vec![1u8; t.data.len()])
        .collect();
    // Touch once so page faults are not counted, then time the copy.
    for (d, t) in dst.iter_mut().zip(&state.tensors) {
        d.copy_from_slice(&t.data);
    }
    let start = Instant::now();
    for (d, t) in dst.iter_mut().zip(&state.tensors) {
        d.copy_from_slice(&t.data);
    }
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    secs
}

/// Seconds to write the state's bytes sequentially to one new file in `dir` and
/// fsync it (and the directory): the floor for persisting to that disk.
pub fn raw_write_fsync_secs(state: &State, dir: &Path) -> std::io::Result<f64> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("raw-baseline-{}.bin", std::process::id()));
    let start = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    for t in &state.tensors {
        f.write_all(&t.data)?;
    }
    f.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    let secs = start.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(secs)
}
