//! The storage conformance suite (`ckpt_core::testing::conformance`) on every backend:
//! `file://`, `memory://`, the tiered store, and S3 on a real Garage node (started
//! by `scripts/test.sh`, which exports the AWS variables).

use ckpt_tests::{s3_url, unique};
use std::sync::Arc;

use ckpt_core::store;
use ckpt_core::testing::conformance;
use ckpt_core::Result;
use ckpt_core::{TieredCheckpointStore, TieredOptions};
use object_store::ObjectStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_memory() -> Result<()> {
    conformance::check_all(
        || Ok(store::memory_store(&unique("conf"))),
        ckpt_formats::native(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_file() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut n = 0;
    let fresh = || {
        n += 1;
        store::open_url(&format!("file://{}/s{n}", dir.path().display()))
    };
    conformance::check_all(fresh, ckpt_formats::native()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_tiered() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut made: Vec<TieredCheckpointStore> = Vec::new();
    let fresh = || -> Result<Arc<dyn ObjectStore>> {
        let fast = store::open_dir(&dir.path().join(format!("fast{}", made.len())))?;
        let durable = store::open_dir(&dir.path().join(format!("durable{}", made.len())))?;
        let t = TieredCheckpointStore::new(fast, durable, TieredOptions::default());
        made.push(t.clone());
        Ok(Arc::new(t))
    };
    conformance::check_all(fresh, ckpt_formats::native()).await?;
    // Whatever was committed on the fast tiers reaches the durable tiers intact.
    for t in &made {
        let report = t.flush().await?;
        assert!(
            report.failed.is_empty(),
            "flush failed: {:?}",
            report.failed
        );
        let fast = ckpt_core::layout::committed(t.fast().as_ref()).await?;
        let durable = ckpt_core::layout::committed(t.durable().as_ref()).await?;
        for id in fast {
            // The torn manifest of check_lists_only_committed is the one thing not flushed.
            if ckpt_core::layout::read_manifest(t.fast().as_ref(), &id)
                .await
                .is_ok()
            {
                assert!(
                    durable.contains(&id),
                    "{id} committed on the fast tier but not flushed"
                );
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_s3() -> Result<()> {
    let Some(base) = s3_url("conf") else {
        return Ok(());
    };
    let mut n = 0;
    let fresh = || {
        n += 1;
        store::open_url(&format!("{base}/s{n}"))
    };
    conformance::check_all(fresh, ckpt_formats::native()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_tiered_over_s3() -> Result<()> {
    let Some(base) = s3_url("conf-tiered") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let mut n = 0;
    let fresh = || {
        n += 1;
        store::open_url(&format!(
            "tiered+file://{}/fast{n}?durable={base}/d{n}",
            dir.path().display()
        ))
    };
    conformance::check_all(fresh, ckpt_formats::native()).await
}
