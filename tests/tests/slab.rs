//! Saves from memory filled outside the engine: a [`Slab`] whose slots are
//! written after `save` returned (as a GPU's device-to-host copies land), with
//! a [`Ready`] gate the snapshot waits on before anything is read.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_core::Slab;
use ckpt_core::{Capture, DType, Error, Ready, SnapshotMode, SourceTensor, TensorData, Value};
use ckpt_tests::*;

/// Opens when the filler says so (a device's copy-done event, here a channel).
#[derive(Debug)]
struct Gate(Mutex<mpsc::Receiver<Result<(), String>>>);

impl Ready for Gate {
    fn wait(&self) -> ckpt_core::Result<()> {
        match self.0.lock().unwrap().recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::InvalidInput(e)),
            Err(_) => Err(Error::Internal("filler vanished".into())),
        }
    }
}

fn capture(slab: &Slab, lens: &[usize], gate: Gate) -> Capture {
    let tensors = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| SourceTensor {
            name: format!("t{i}"),
            dtype: DType::U8,
            shape: vec![len as u64],
            shard: None,
            data: TensorData::Shared(slab.slot(i).unwrap()),
        })
        .collect();
    Capture {
        tensors,
        meta: Value::Null,
        ready: Some(Arc::new(gate)),
    }
}

fn fill(slab: &Slab, i: usize, byte: u8) {
    let (at, len) = slab.slots()[i];
    // SAFETY: the test is the slab's only writer, and the engine reads it only
    // after the gate opened.
    unsafe { std::ptr::write_bytes((slab.address() + at) as *mut u8, byte, len) };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_save_waits_for_its_gate_and_stores_what_landed_before_it_opened() {
    let cp = ckpt_formats::builder(memory_root("slab-lazy"))
        .snapshot(SnapshotMode::Lazy)
        .build()
        .await
        .unwrap();
    let lens = [3 << 20, 100, 70_000];
    let slab = Slab::new(&lens).unwrap();
    let (tx, rx) = mpsc::channel();
    let h = cp
        .save(1, capture(&slab, &lens, Gate(Mutex::new(rx))))
        .await
        .unwrap();
    // `save` returned with nothing filled yet: the snapshot is still waiting.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!h.snapshot_done(), "the snapshot waits for its gate");
    for i in 0..lens.len() {
        fill(&slab, i, 10 + i as u8);
    }
    tx.send(Ok(())).unwrap();
    h.wait_snapshot().await.unwrap();
    h.wait().await.unwrap();
    assert!(!slab.in_use(), "a committed save holds none of the slab");
    let loaded = cp.load_latest().await.unwrap().unwrap();
    for (i, t) in loaded.state.tensors.iter().enumerate() {
        assert_eq!(t.name, format!("t{i}"));
        assert!(t.data.iter().all(|&b| b == 10 + i as u8), "{}", t.name);
        assert_eq!(t.data.len(), lens[i]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_that_fails_fails_the_save_and_commits_nothing() {
    for mode in [SnapshotMode::Lazy, SnapshotMode::Eager] {
        let cp = ckpt_formats::builder(memory_root("slab-fail"))
            .snapshot(mode)
            .build()
            .await
            .unwrap();
        let lens = [4096, 10];
        let slab = Slab::new(&lens).unwrap();
        let (tx, rx) = mpsc::channel();
        tx.send(Err("the device copy failed".into())).unwrap();
        let r = match cp
            .save(1, capture(&slab, &lens, Gate(Mutex::new(rx))))
            .await
        {
            Ok(h) => {
                let snap = h.wait_snapshot().await;
                assert!(
                    snap.is_err(),
                    "{mode:?}: the snapshot reports the gate's error"
                );
                h.wait().await
            }
            Err(e) => Err(e),
        };
        let e = r.unwrap_err();
        assert!(
            e.to_string().contains("device copy failed"),
            "{mode:?}: {e}"
        );
        assert!(cp.load_latest().await.unwrap().is_none(), "{mode:?}");
        assert!(!slab.in_use(), "{mode:?}: a failed save lets the slab go");
    }
}
