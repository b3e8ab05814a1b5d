//! Damaged checkpoints give typed errors naming the object and tensor, and
//! `load_latest` falls back to the newest intact one.

use std::path::Path;

use ckpt_core::{Checkpointer, Error, Layout};
use ckpt_tests::*;

async fn two_checkpoints() -> (tempfile::TempDir, Checkpointer, ckpt_core::State) {
    let (dir, url) = temp_root();
    let cp = open_small_chunks(&url).await;
    let old = f32_state(3, 2000, 1);
    cp.save(10, &old).await.unwrap().wait().await.unwrap();
    cp.save(20, &f32_state(3, 2000, 1000))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    (dir, cp, old)
}

/// Path of the first chunk of tensor `i` of the newest checkpoint.
async fn newest_chunk(
    cp: &Checkpointer,
    dir: &Path,
    i: usize,
) -> (String, std::path::PathBuf, String) {
    let id = cp.committed().await.unwrap().pop().unwrap();
    let m = cp.manifest(&id).await.unwrap();
    let Layout::Chunks { chunks } = &m.tensors[i].layout else {
        panic!("chunked")
    };
    let key = format!("chunks/{}", chunks[0].hash);
    (key.clone(), dir.join(&key), m.tensors[i].name.clone())
}

/// The newest checkpoint's id, and its manifest's key and file.
async fn newest_manifest(
    cp: &Checkpointer,
    dir: &Path,
) -> (ckpt_core::CheckpointId, String, std::path::PathBuf) {
    let id = cp.committed().await.unwrap().pop().unwrap();
    let key = ckpt_core::layout::manifest_key(&id).to_string();
    let path = dir.join(&key);
    (id, key, path)
}

async fn expect_fallback(
    dir: &Path,
    old: &ckpt_core::State,
) -> Vec<(ckpt_core::CheckpointId, Error)> {
    let url = format!("file://{}", dir.display());
    // A reader beside the writer: it must not fence it.
    let cp = ckpt_formats::builder(&url)
        .read_only()
        .build()
        .await
        .unwrap();
    let loaded = cp.load_latest().await.unwrap().expect("falls back");
    assert_eq!(loaded.id.step, 10);
    assert_same(old, &loaded.state);
    assert_eq!(loaded.skipped.len(), 1);
    assert_eq!(loaded.skipped[0].0.step, 20);
    loaded.skipped
}

/// `load_into` caller buffers of every tensor of the newest checkpoint, both
/// ways the native format reads: here, on the test's one-thread runtime (each
/// tensor on tokio tasks, raw chunks verified on other threads while copied),
/// and on a multi-threaded runtime (the whole batch read in place by scoped
/// threads), and `load` into new buffers on the latter (the same batch).
/// Returns the three errors.
async fn load_into_err(cp: &Checkpointer) -> [Error; 3] {
    async fn load(cp: &Checkpointer) -> Error {
        let id = cp.committed().await.unwrap().pop().unwrap();
        let m = cp.manifest(&id).await.unwrap();
        let mut bufs: Vec<(String, Vec<u8>)> = m
            .tensors
            .iter()
            .map(|t| {
                let n: u64 = t.shape.iter().product();
                (t.name.clone(), vec![0u8; (n * 4) as usize])
            })
            .collect();
        let targets = bufs
            .iter_mut()
            .map(|(n, b)| (n.as_str(), b.as_mut_slice()))
            .collect();
        cp.load_into(&id, targets).await.unwrap_err()
    }
    let tasks = load(cp).await;
    let cp2 = cp.clone();
    // Awaited, not joined: the failed load's verifications, spawned on this
    // runtime, may hold turns of the process's CPU budget that the batch
    // read needs, and they end only if this runtime goes on polling them.
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let out = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let id = cp2.committed().await.unwrap().pop().unwrap();
                (load(&cp2).await, cp2.load(&id).await.unwrap_err())
            });
        let _ = tx.send(out);
    });
    let (batch, whole) = rx.await.expect("the batch load's thread panicked");
    [tasks, batch, whole]
}

fn assert_corrupt(e: &Error, object: &str, tensor: Option<&str>) {
    match e {
        Error::Corrupt {
            object: o,
            tensor: t,
            ..
        } => {
            assert_eq!(o, object);
            assert_eq!(t.as_deref(), tensor);
        }
        other => panic!("expected Corrupt for {object}, got {other:?}"),
    }
}

#[tokio::test]
async fn flipped_byte_in_chunk() {
    let (dir, cp, old) = two_checkpoints().await;
    let (key, path, tensor) = newest_chunk(&cp, dir.path(), 1).await;
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let id = cp.committed().await.unwrap().pop().unwrap();
    assert_corrupt(&cp.load(&id).await.unwrap_err(), &key, Some(&tensor));
    for e in load_into_err(&cp).await {
        assert_corrupt(&e, &key, Some(&tensor));
    }
    assert!(cp.verify(&id).await.is_err());
    let skipped = expect_fallback(dir.path(), &old).await;
    assert_corrupt(&skipped[0].1, &key, Some(&tensor));
    // The job falls back to step 10 and redoes step 20: the damaged checkpoint of
    // step 20 does not block the new save, and the new one is what loads.
    let restarted = open_small_chunks(&format!("file://{}", dir.path().display())).await;
    assert_eq!(restarted.load_latest().await.unwrap().unwrap().id.step, 10);
    let redone = f32_state(3, 2000, 4000);
    restarted
        .save(20, &redone)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let latest = restarted.load_latest().await.unwrap().unwrap();
    assert_eq!(latest.id.step, 20);
    assert_same(&redone, &latest.state);
    // A checkpointer that has not seen the damage still refuses to save step 20 again.
    assert!(matches!(
        cp.save(20, &redone).await,
        Err(Error::Conflict(_))
    ));
}

#[tokio::test]
async fn truncated_chunk() {
    let (dir, cp, old) = two_checkpoints().await;
    let (key, path, tensor) = newest_chunk(&cp, dir.path(), 0).await;
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    for e in load_into_err(&cp).await {
        assert_corrupt(&e, &key, Some(&tensor));
    }
    let skipped = expect_fallback(dir.path(), &old).await;
    assert_corrupt(&skipped[0].1, &key, Some(&tensor));
}

#[tokio::test]
async fn deleted_chunk() {
    let (dir, cp, old) = two_checkpoints().await;
    let (key, path, tensor) = newest_chunk(&cp, dir.path(), 2).await;
    std::fs::remove_file(&path).unwrap();
    for e in load_into_err(&cp).await {
        assert_corrupt(&e, &key, Some(&tensor));
    }
    let skipped = expect_fallback(dir.path(), &old).await;
    assert_corrupt(&skipped[0].1, &key, Some(&tensor));
}

#[tokio::test]
async fn corrupt_manifest() {
    let (dir, cp, old) = two_checkpoints().await;
    let (id, key, path) = newest_manifest(&cp, dir.path()).await;
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    assert_corrupt(&cp.manifest(&id).await.unwrap_err(), &key, None);
    let skipped = expect_fallback(dir.path(), &old).await;
    assert_corrupt(&skipped[0].1, &key, None);
    let listed = cp.list(false).await.unwrap();
    assert!(matches!(
        listed.last().unwrap().status,
        ckpt_core::Status::Corrupt(_)
    ));
    // A manifest that does not decode commits nothing: the step can be saved again,
    // and the damaged manifest is left where it was.
    let again = f32_state(3, 2000, 3000);
    cp.save(20, &again).await.unwrap().wait().await.unwrap();
    let latest = cp.load_latest().await.unwrap().unwrap();
    assert_eq!(latest.id.step, 20);
    assert_same(&again, &latest.state);
    assert!(path.exists());
}

/// A manifest of another schema version (a newer ckpt wrote it) is not
/// damage: `load_latest` stops at it instead of resuming the older
/// checkpoint, whose saves and retention would then bury the newer one. The
/// same version digit damaged in the header alone (the body, which the hash
/// covers, still says this version) is damage, and passed over.
#[tokio::test]
async fn a_newer_writers_manifest_stops_load_latest_but_a_damaged_version_digit_does_not() {
    let (dir, cp, old) = two_checkpoints().await;
    let (_, key, path) = newest_manifest(&cp, dir.path()).await;
    let ours = std::fs::read(&path).unwrap();
    let nl = ours.iter().position(|&b| b == b'\n').unwrap();
    let header = std::str::from_utf8(&ours[..nl]).unwrap().to_owned();
    // A job of one rank writes the manifest that holds its records.
    let (ours_v, v) = (
        ckpt_core::layout::MANIFEST_VERSION_INLINE,
        ckpt_core::layout::MANIFEST_VERSION + 1,
    );
    let damaged = header.replacen(&format!(" {ours_v} "), &format!(" {v} "), 1);
    assert_ne!(damaged, header);
    std::fs::write(&path, [damaged.as_bytes(), &ours[nl..]].concat()).unwrap();
    let skipped = expect_fallback(dir.path(), &old).await;
    assert_corrupt(&skipped[0].1, &key, None);

    let mut body: serde_json::Value = serde_json::from_slice(&ours[nl + 1..]).unwrap();
    body["version"] = v.into();
    let body = serde_json::to_vec(&body).unwrap();
    let magic = header.split(' ').next().unwrap();
    let newer = format!(
        "{magic} {v} {} {}\n",
        blake3::hash(&body).to_hex(),
        body.len()
    );
    std::fs::write(&path, [newer.as_bytes(), &body].concat()).unwrap();
    let url = format!("file://{}", dir.path().display());
    let reader = ckpt_formats::builder(&url)
        .read_only()
        .build()
        .await
        .unwrap();
    match reader.load_latest().await {
        Err(Error::Unsupported(msg)) => assert!(msg.contains("schema version"), "{msg}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    let listed = reader.list(true).await.unwrap();
    assert!(
        matches!(&listed.last().unwrap().status, ckpt_core::Status::Unsupported(m) if m.contains("schema version")),
        "{:?}",
        listed.last().unwrap().status
    );
    assert_eq!(listed[0].status, ckpt_core::Status::Committed);
    // Nor does it commit nothing: its step is taken, and later ones wait on it.
    assert!(matches!(
        cp.save(20, &f32_state(3, 2000, 7)).await,
        Err(Error::Unsupported(_))
    ));
}

/// A manifest the store says is 1 TiB (a sparse file) is refused by its size,
/// before its body is read: reading it would try to allocate all of it.
#[tokio::test]
async fn a_huge_manifest_is_refused_before_it_is_read() {
    let (dir, cp, old) = two_checkpoints().await;
    let (id, key, path) = newest_manifest(&cp, dir.path()).await;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let err = cp.manifest(&id).await.unwrap_err();
    assert_corrupt(&err, &key, None);
    assert!(err.to_string().contains("exceeds the cap"), "{err}");
    let skipped = expect_fallback(dir.path(), &old).await;
    assert_corrupt(&skipped[0].1, &key, None);
}

#[tokio::test]
async fn truncated_single_file_format_object() {
    // Range layouts (safetensors, .pt, HDF5): a file cut short is corruption, found by
    // its length, not by the wording of a storage error.
    let (dir, url) = temp_root();
    let cp = ckpt_formats::builder(&url)
        .format(ckpt_formats::by_name("safetensors").unwrap())
        .build()
        .await
        .unwrap();
    let old = f32_state(2, 500, 1);
    cp.save(1, &old).await.unwrap().wait().await.unwrap();
    let r = cp
        .save(2, &f32_state(2, 500, 50))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let m = cp.manifest(&r.id).await.unwrap();
    let Layout::Range { object, .. } = &m.tensors[1].layout else {
        panic!("range layout")
    };
    let path = dir.path().join(object);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    assert_corrupt(
        &cp.load(&r.id).await.unwrap_err(),
        object,
        Some(&m.tensors[1].name),
    );
    let loaded = cp.load_latest().await.unwrap().expect("falls back");
    assert_eq!(loaded.id.step, 1);
    assert_same(&old, &loaded.state);
    assert_eq!(loaded.skipped.len(), 1);
    assert_corrupt(&loaded.skipped[0].1, object, Some(&m.tensors[1].name));
}

#[tokio::test]
async fn a_corrupt_chunk_is_rewritten_by_the_next_save() {
    // Content addressing must not make a damaged chunk poison later checkpoints.
    let (dir, url) = temp_root();
    let cp = open_small_chunks(&url).await;
    let s = f32_state(1, 1000, 5);
    cp.save(1, &s).await.unwrap().wait().await.unwrap();
    let (_, path, _) = newest_chunk(&cp, dir.path(), 0).await;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[20] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    assert!(
        cp.load_latest().await.unwrap().is_none(),
        "the only checkpoint is damaged"
    );
    // The load forgot the bad chunk: the next save of the same content rewrites it.
    let r = cp.save(2, &s).await.unwrap().wait().await.unwrap();
    assert!(r.stored_bytes > 0);
    let loaded = cp.load_latest().await.unwrap().unwrap();
    assert_eq!(loaded.id.step, 2);
    assert_same(&s, &loaded.state);
}
