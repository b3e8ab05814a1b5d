use std::fs;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

use super::*;
use crate::layout::manifest::{ChunkRef, TensorRecord, MANIFEST_VERSION_INLINE};
use crate::layout::pymeta::{self, Bookkeeping};
use crate::model::dtype::DType;
use crate::model::value::Value;

fn id(step: u64, attempt: &str) -> CheckpointId {
    CheckpointId {
        step,
        attempt: attempt.into(),
    }
}

/// A checkpoint of one tensor over `hashes` (8 bytes each, stored in 24),
/// saved by `rank` of `ranks`, listing `objects`.
fn manifest(step: u64, hashes: &[&str], objects: &[&str], rank: u64, ranks: u64) -> Manifest {
    let chunks: Vec<ChunkRef> = hashes
        .iter()
        .map(|h| ChunkRef {
            hash: h.repeat(64),
            len: 8,
            stored: 24,
            offset: None,
        })
        .collect();
    let info = Bookkeeping {
        memory: Some((rank, ranks)),
        ..Bookkeeping::default()
    };
    Manifest {
        version: MANIFEST_VERSION_INLINE,
        library: "ckpt test".into(),
        format: "native".into(),
        step,
        attempt: "a1".into(),
        world_size: 1,
        created_unix_ms: 1,
        epoch: 0,
        tensors: vec![TensorRecord {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![2 * chunks.len() as u64],
            shard: None,
            layout: Layout::Chunks { chunks },
        }],
        meta: pymeta::meta(&info, Value::Map(Vec::new())),
        objects: objects.iter().map(|o| o.to_string()).collect(),
        fragments: vec![],
        index: vec![],
    }
}

/// A root with the objects of `m` (24 bytes each) and then its manifest.
fn commit(root: &LocalRoot, m: &Manifest) -> CheckpointId {
    for (key, _) in references(m).unwrap() {
        root.write(&key, &[7; 24]).unwrap();
    }
    root.write_manifest(&m.encode().unwrap()).unwrap()
}

fn roots() -> (tempfile::TempDir, LocalRoot) {
    let dir = tempfile::tempdir().unwrap();
    let root = LocalRoot::open(dir.path().join("r"), dir.path().join("in")).unwrap();
    (dir, root)
}

#[test]
fn only_names_the_layout_reads_are_committed() {
    let (_d, root) = roots();
    let ok = commit(&root, &manifest(12, &["a"], &[], 0, 1));
    fs::create_dir_all(root.path().join(MANIFESTS)).unwrap();
    // Names the package's own parser took: a short step, any attempt.
    for name in [
        "12-ab.manifest",
        "00000000000000000012-a_b.manifest",
        "00000000000000000012-a-b.manifest",
        "00000000000000000012-.manifest",
        "0000000000000000001x-ab.manifest",
        "00000000000000000013-ab.manifest#17",
        "00000000000000000013-ab",
    ] {
        fs::write(root.path().join(MANIFESTS).join(name), b"x").unwrap();
    }
    assert_eq!(root.committed().unwrap(), vec![ok]);
    assert_eq!(
        manifest_key(&id(12, "a1")),
        "manifests/00000000000000000012-a1.manifest"
    );
    assert!(checkpoint_id(3, "a_b").is_err() && checkpoint_id(3, "").is_err());
    assert!(checkpoint_id(3, "../x").is_err());
    assert_eq!(checkpoint_id(3, "ab").unwrap(), id(3, "ab"));
    let empty = LocalRoot::open(root.path().join("fresh"), root.incoming()).unwrap();
    assert_eq!(empty.committed().unwrap(), vec![]);
}

#[test]
fn objects_list_what_the_manifest_references_and_the_manifest_last() {
    let (_d, root) = roots();
    let m = manifest(
        5,
        &["b", "a", "b"],
        &["data/00000000000000000005-a1/rank0"],
        2,
        4,
    );
    let ckpt = commit(&root, &m);
    let objects = root.objects(&ckpt).unwrap();
    let keys: Vec<&str> = objects.iter().map(|(k, _)| k.as_str()).collect();
    let (a, b) = ("a".repeat(64), "b".repeat(64));
    assert_eq!(
        keys,
        [
            format!("chunks/{b}").as_str(),
            &format!("chunks/{a}"),
            "data/00000000000000000005-a1/rank0",
            &manifest_key(&ckpt),
        ]
    );
    let size = fs::metadata(root.path().join(manifest_key(&ckpt)))
        .unwrap()
        .len();
    assert_eq!(objects.last().unwrap().1, size);
    assert!(objects[..3].iter().all(|(_, n)| *n == 24));
    assert_eq!(references(&m).unwrap()[0].1, Some(24));
    assert_eq!(references(&m).unwrap()[2].1, None);
    assert_eq!(root.identity(&ckpt), Some((2, 4)));
    assert_eq!(root.identity(&id(6, "a1")), None);
    let odd = commit(&root, &manifest(7, &["a"], &[], 4, 4));
    assert_eq!(root.identity(&odd), None);
}

#[test]
fn a_referenced_object_that_is_missing_is_not_found_and_pins_nothing() {
    let (dir, root) = roots();
    let ckpt = commit(&root, &manifest(5, &["a", "c"], &[], 0, 1));
    fs::remove_file(root.path().join(format!("chunks/{}", "c".repeat(64)))).unwrap();
    assert!(matches!(root.objects(&ckpt), Err(Error::NotFound { .. })));
    let into = dir.path().join("pinned");
    assert!(root.pin(&ckpt, &into).unwrap().is_none());
    assert!(!into.exists());
    // A checkpoint that is gone altogether: the same.
    assert!(root.pin(&id(9, "a1"), &into).unwrap().is_none());
    assert!(matches!(
        root.manifest(&id(9, "a1")),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn a_pin_shares_the_files_and_outlives_the_checkpoint() {
    let (dir, root) = roots();
    let ckpt = commit(&root, &manifest(5, &["a"], &[], 0, 1));
    let into = dir.path().join("pinned");
    fs::create_dir_all(into.join("stale")).unwrap();
    let pinned = root.pin(&ckpt, &into).unwrap().unwrap();
    assert_eq!(pinned, root.objects(&ckpt).unwrap());
    assert!(!into.join("stale").exists());
    for (key, _) in &pinned {
        let (a, b) = (
            fs::metadata(root.path().join(key)).unwrap(),
            fs::metadata(into.join(key)).unwrap(),
        );
        assert_eq!(a.ino(), b.ino(), "{key}");
    }
    root.drop_checkpoint(&ckpt).unwrap();
    fs::remove_dir_all(root.path().join("chunks")).unwrap();
    let kept = LocalRoot::open(&into, root.incoming()).unwrap();
    assert_eq!(kept.objects(&ckpt).unwrap(), pinned);
    // Brought back into another root.
    let back = LocalRoot::open(dir.path().join("back"), root.incoming()).unwrap();
    for (key, _) in &pinned {
        back.link_from(&kept, key).unwrap();
    }
    assert_eq!(back.committed().unwrap(), vec![ckpt.clone()]);
    assert_eq!(back.objects(&ckpt).unwrap(), pinned);
}

#[test]
fn writes_are_whole_and_keys_stay_under_the_root() {
    let (dir, root) = roots();
    root.write("chunks/x", b"hello").unwrap();
    root.write("chunks/x", b"again!").unwrap();
    assert_eq!(root.read("chunks/x").unwrap().unwrap(), b"again!");
    assert_eq!(root.size("chunks/x").unwrap(), Some(6));
    assert!(root.has("chunks/x", 6).unwrap() && !root.has("chunks/x", 5).unwrap());
    assert_eq!(root.size("chunks/y").unwrap(), None);
    assert_eq!(root.read("chunks/y").unwrap(), None);
    let mut buf = [0u8; 6];
    assert!(root.read_into("chunks/x", &mut buf).unwrap());
    assert_eq!(&buf, b"again!");
    assert!(!root.read_into("chunks/x", &mut [0u8; 5]).unwrap());
    assert!(!root.read_into("chunks/y", &mut buf).unwrap());
    assert_eq!(fs::read_dir(root.incoming()).unwrap().count(), 0);
    for bad in ["../escape", "/abs", "", "a//b", "a/./b"] {
        assert!(
            matches!(root.write(bad, b"x"), Err(Error::InvalidInput(_))),
            "{bad}"
        );
        assert!(root.size(bad).is_err() && root.read(bad).is_err(), "{bad}");
    }
    assert!(!dir.path().join("escape").exists());
}

#[test]
fn a_manifest_is_written_only_when_it_verifies() {
    let (_d, root) = roots();
    let raw = manifest(5, &["a"], &[], 1, 2).encode().unwrap();
    let mut damaged = raw.clone();
    let at = damaged
        .windows(8)
        .position(|w| w == b"\"hash\":\"")
        .unwrap()
        + 8;
    damaged[at] = if damaged[at] == b'a' { b'b' } else { b'a' };
    assert!(matches!(
        root.write_manifest(&damaged),
        Err(Error::Corrupt { .. })
    ));
    assert_eq!(root.committed().unwrap(), vec![]);
    // A damaged copy already stored: what it references and who saved it are
    // still read (a load finds the damage).
    fs::create_dir_all(root.path().join(MANIFESTS)).unwrap();
    fs::write(root.path().join(manifest_key(&id(5, "a1"))), &damaged).unwrap();
    assert_eq!(root.identity(&id(5, "a1")), Some((1, 2)));
    assert!(matches!(
        root.write_manifest(b"no header"),
        Err(Error::Corrupt { .. })
    ));
    assert!(matches!(
        Manifest::decode_unverified(b"no header", "m"),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn drops_uncommit() {
    let (_d, root) = roots();
    let ids: Vec<_> = (1..=4)
        .map(|s| commit(&root, &manifest(s, &["a"], &[], 0, 1)))
        .collect();
    root.drop_newer(2).unwrap();
    assert_eq!(root.committed().unwrap(), ids[..2]);
    root.drop_checkpoint(&ids[0]).unwrap();
    root.drop_checkpoint(&ids[0]).unwrap(); // already gone: nothing to do
    assert_eq!(root.committed().unwrap(), ids[1..2]);
}

#[tokio::test]
async fn retention_keeps_the_newest_and_what_they_reference() {
    let (_d, root) = roots();
    let old = commit(&root, &manifest(1, &["a"], &[], 0, 1));
    let new = commit(&root, &manifest(2, &["b"], &[], 0, 1));
    // Older than the grace period, as after a while of training.
    let past = SystemTime::now() - Duration::from_secs(3600);
    for h in ["a", "b"] {
        let f = fs::File::options()
            .write(true)
            .open(root.path().join(format!("chunks/{}", h.repeat(64))));
        f.unwrap().set_modified(past).unwrap();
    }
    let report = root.retain(1).await.unwrap();
    assert_eq!(report.retired, vec![old]);
    assert_eq!(root.committed().unwrap(), vec![new.clone()]);
    assert_eq!(
        root.size(&format!("chunks/{}", "a".repeat(64))).unwrap(),
        None
    );
    assert!(root.objects(&new).is_ok());
}
