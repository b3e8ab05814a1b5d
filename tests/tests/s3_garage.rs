//! The engine on S3 against a real Garage node on loopback (started by
//! `scripts/test.sh`): multipart objects, configuration errors, a tiered store with
//! S3 as the durable tier, and (ignored by default) a throughput comparison with
//! the local disk:
//!
//! ```text
//! eval "$(scripts/garage.sh start)"
//! cargo test --release -p ckpt-tests --features ckpt-core/s3 --test s3_garage -- --ignored --nocapture
//! scripts/garage.sh stop
//! ```

use ckpt_tests::s3_url;
use std::sync::Arc;
use std::time::Instant;

use ckpt_core::store::{self, CountingStore, S3Options};
use ckpt_core::{CheckpointerOptions, Error, Result, State, Tensor};
use object_store::ObjectStore;

fn big_state(tensors: usize, floats: usize, seed: u32) -> State {
    let mut s = State::new();
    for t in 0..tensors {
        let v: Vec<f32> = (0..floats)
            .map(|i| (i as u32 ^ (t as u32 * 7919) ^ seed) as f32)
            .collect();
        s = s.with_tensor(Tensor::from_f32(format!("layer{t}"), vec![floats as u64], &v).unwrap());
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_checkpoint_in_parts_round_trips() -> Result<()> {
    let Some(url) = s3_url("multipart") else {
        return Ok(());
    };
    let counting = CountingStore::new(store::open_url(&url)?);
    let mut opts = CheckpointerOptions::default();
    opts.write.chunk_size = 24 << 20; // chunks above the threshold go up in parts
    opts.write.multipart_threshold = 8 << 20;
    let cp = ckpt_formats::builder(url.as_str())
        .store(Arc::new(counting.clone()))
        .options(opts)
        .build()
        .await?;
    let state = big_state(2, 7 << 20, 1); // two 28 MiB tensors
    let report = cp.save(1, &state).await?.wait().await?;
    let n = counting.counts();
    assert!(
        n.multipart_completes >= 2 && n.parts >= 4,
        "no multipart upload happened: {n:?}"
    );
    assert_eq!(report.raw_bytes, 2 * (28 << 20));

    // A second process (fresh store, fresh chunk index) loads it back exactly.
    let cp2 = ckpt_formats::builder(url.as_str())
        .read_only()
        .build()
        .await?;
    let loaded = cp2.load_latest().await?.expect("committed on S3");
    assert_eq!(loaded.state, state);
    // An unchanged tensor is not uploaded again.
    let before = counting.counts();
    let next =
        state
            .clone()
            .with_tensor(Tensor::from_f32("extra", vec![4], &[1.0, 2.0, 3.0, 4.0])?);
    let r2 = cp.save(2, &next).await?.wait().await?;
    assert_eq!(r2.reused_bytes, 2 * (28 << 20));
    assert!((counting.counts() - before).written_bytes() < 1 << 20);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_file_format_loads_merge_their_ranged_reads() -> Result<()> {
    let Some(url) = s3_url("ranges") else {
        return Ok(());
    };
    let safetensors = || ckpt_formats::by_name("safetensors").unwrap();
    let state =
        big_state(300, 1000, 3).with_tensor(Tensor::from_f32("empty", vec![0], &[]).unwrap());
    let cp = ckpt_formats::builder(url.as_str())
        .format(safetensors())
        .build()
        .await?;
    cp.save(1, &state).await?.wait().await?;

    // A fresh checkpointer: a few merged GETs, not one per tensor.
    let counting = CountingStore::new(store::open_url(&url)?);
    let cp2 = ckpt_formats::builder(url.as_str())
        .store(Arc::new(counting.clone()))
        .capabilities(store::Capabilities::of_url(&url))
        .build()
        .await?;
    let id = cp2.committed().await?.pop().expect("committed on S3");
    let before = counting.counts();
    let loaded = cp2.load(&id).await?;
    assert_eq!(loaded.state.tensors, state.tensors);
    let gets = (counting.counts() - before).gets;
    assert!(gets < 20, "{gets} GETs for 301 tensors");

    // In place too.
    let mut bufs: Vec<Vec<u8>> = state
        .tensors
        .iter()
        .map(|t| vec![0; t.data.len()])
        .collect();
    let targets = state
        .tensors
        .iter()
        .zip(bufs.iter_mut())
        .map(|(t, b)| (t.name.as_str(), b.as_mut_slice()))
        .collect();
    let before = counting.counts();
    cp2.load_into(&id, targets).await?;
    for (t, b) in state.tensors.iter().zip(&bufs) {
        assert_eq!(&t.data[..], &b[..], "{}", t.name);
    }
    let gets = (counting.counts() - before).gets;
    assert!(gets < 20, "{gets} GETs for 301 tensors in place");
    Ok(())
}

#[tokio::test]
async fn s3_configuration_errors_are_typed() {
    assert!(matches!(
        store::open_url("s3:///no-bucket"),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        S3Options::from_url("s3://b/p?versionId=3"),
        Err(Error::InvalidInput(_))
    ));
    if std::env::var("AWS_ACCESS_KEY_ID").is_err()
        && std::env::var("AWS_SECRET_ACCESS_KEY").is_err()
    {
        let e = store::open_url("s3://bucket/prefix").unwrap_err();
        assert!(
            matches!(e, Error::InvalidInput(_) | Error::Unsupported(_)),
            "{e}"
        );
        assert!(
            e.to_string().contains("AWS_ACCESS_KEY_ID") || e.to_string().contains("`s3` feature"),
            "{e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_with_s3_durable_recovers_after_losing_the_fast_tier() -> Result<()> {
    let Some(durable) = s3_url("tiered") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let fast = dir.path().join("fast");
    let url = format!(
        "tiered+file://{}?durable={durable}&durable_keep_last=2",
        fast.display()
    );
    let tiered = store::open_tiered(&url)?;
    let cp = ckpt_formats::builder(url.as_str())
        .store(Arc::new(tiered.clone()))
        .build()
        .await?;
    for step in 1..=3 {
        cp.save(step, &big_state(3, 50_000, step as u32))
            .await?
            .wait()
            .await?;
    }
    let report = tiered.flush().await?;
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    let on_s3 = ckpt_core::layout::committed(tiered.durable().as_ref()).await?;
    assert_eq!(
        on_s3.iter().map(|id| id.step).collect::<Vec<_>>(),
        vec![2, 3],
        "S3 keeps the newest two"
    );

    std::fs::remove_dir_all(&fast)?;
    let cp = ckpt_formats::builder(url.as_str()).build().await?;
    let loaded = cp.load_latest().await?.expect("S3 has checkpoints");
    assert_eq!((loaded.id.step, loaded.state), (3, big_state(3, 50_000, 3)));
    Ok(())
}

async fn throughput(
    label: &str,
    store: Arc<dyn ObjectStore>,
    state: &State,
    seed: u32,
    rounds: u64,
) -> Result<f64> {
    let cp = ckpt_formats::builder(label).store(store).build().await?;
    let mut best = f64::MAX;
    for step in 0..rounds {
        // A fresh state each round (made before the clock starts), so every chunk is really written.
        let s = big_state(
            state.tensors.len(),
            state.tensors[0].data.len() / 4,
            seed + step as u32,
        );
        let t = Instant::now();
        let r = cp.save(step, &s).await?.wait().await?;
        let save_s = t.elapsed().as_secs_f64();
        best = best.min(save_s);
        assert_eq!(r.reused_bytes, 0);
        let l = Instant::now();
        let loaded = cp.load(&r.id).await?;
        assert_eq!(loaded.state, s);
        let gb = r.raw_bytes as f64 / 1e9;
        let load_s = l.elapsed().as_secs_f64();
        eprintln!(
            "{label}: save {save_s:.3} s ({:.2} GB/s), load {load_s:.3} s ({:.2} GB/s)",
            gb / save_s,
            gb / load_s
        );
    }
    Ok(state
        .tensors
        .iter()
        .map(|t| t.data.len() as f64)
        .sum::<f64>()
        / 1e9
        / best)
}

/// Prints save throughput of the same 256 MiB state to the local disk and to S3 on
/// Garage (loopback). Measures only; asserts nothing about speed.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "throughput measurement; run with --ignored --nocapture"]
async fn throughput_s3_vs_local_disk() -> Result<()> {
    let Some(url) = s3_url("throughput") else {
        return Ok(());
    };
    let state = big_state(16, 4 << 20, 5); // 16 x 16 MiB
    let dir = tempfile::tempdir_in(std::env::current_dir()?)?;
    let disk = throughput("file", store::open_dir(dir.path())?, &state, 10, 3).await?;
    let s3 = throughput("s3", store::open_url(&url)?, &state, 20, 3).await?;
    eprintln!("best save throughput of 256 MiB: local disk {disk:.2} GB/s, S3 on Garage (loopback) {s3:.2} GB/s");
    Ok(())
}
