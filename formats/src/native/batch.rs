//! The native format's `read_many_into`: every chunk of a batch of tensors read
//! straight into the tensors' buffers by scoped threads.
//!
//! The per-tensor path (`read_into`) runs on tokio tasks, which cannot lend a
//! borrowed buffer to a blocking thread, so a local chunk goes into a fresh
//! buffer (zeroed and page-faulted by the store), is verified, and is copied
//! into the tensor. Here the batch is planned first, each chunk with the
//! slices of the buffers it fills, and then run inside `block_in_place` by
//! `load_concurrency` scoped threads that hold those slices for the length of
//! the batch. A raw chunk of a local file (the default) is read with `pread`
//! straight into the tensor and hashed there: one kernel copy, no buffer, and
//! with many reads in flight the disk stays busy while other threads hash.
//! So is a raw packed chunk whose tensors are all in the batch, each tensor's
//! bytes read into it in chunk order and hashed across them. Compressed
//! chunks, packed chunks of which only some tensors are wanted, and the chunks
//! of other stores go through a buffer, as on the per-tensor path. Hashing and decoding run within the
//! process's CPU budget.
//!
//! `block_in_place` needs a multi-threaded runtime; on any other the batch
//! goes through `read_into`. The batch runs in windows of at most
//! [`WINDOW_BYTES`]; the load yields between them, so dropping its future (a
//! cancelled restore) waits for one window at most.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use bytes::Bytes;
use ckpt_core::format::io::storage_err;
use ckpt_core::layout::chunk_key;
use ckpt_core::sync::MutexExt;
use ckpt_core::{Error, Layout, ReadContext, Result, TensorRecord, MAX_CHUNK_BYTES};
use object_store::{GetResultPayload, ObjectStoreExt};
use tokio::runtime::{Handle, RuntimeFlavor};

use super::chunk;
use crate::error::CodecError;

/// Bytes of tensors read between two chances for the load to be cancelled.
pub const WINDOW_BYTES: u64 = 256 << 20;

/// Where the bytes of one stored chunk go.
enum Dst<'a> {
    /// The whole chunk, into one slice of a tensor.
    Whole(&'a mut [u8]),
    /// Slices of a packed chunk: (offset in the chunk, the tensor's buffer).
    Packed(Members<'a>),
}

/// One chunk to read, and where its bytes go.
struct Job<'a> {
    hash: &'a str,
    /// The tensor named in errors (the first of a packed chunk's).
    tensor: &'a str,
    dst: Dst<'a>,
}

impl Job<'_> {
    fn bytes(&self) -> u64 {
        match &self.dst {
            Dst::Whole(d) => d.len() as u64,
            Dst::Packed(m) => m.iter().map(|(_, d)| d.len() as u64).sum(),
        }
    }
}

/// A zeroed buffer of `record`'s length, for a load that returns new memory.
///
/// Zeroed by the allocator (fresh pages are zero, so nothing is written
/// twice), and refused with a typed error, not an abort, when a manifest
/// claims more than can be allocated.
pub fn zeroed(record: &TensorRecord) -> Result<Vec<u8>> {
    let too_big = || {
        Error::corrupt(
            "manifest",
            Some(&record.name),
            "the tensor's length cannot be allocated",
        )
    };
    let n = usize::try_from(record.nbytes()?).map_err(|_| too_big())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| too_big())?;
    // SAFETY: `layout` has a non-zero size. A non-null result is `n` zeroed
    // bytes from the global allocator with the layout of `[u8; n]`, which is
    // what `Vec::<u8>::from_raw_parts(p, n, n)` takes ownership of.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout);
        if p.is_null() {
            return Err(too_big());
        }
        Ok(Vec::from_raw_parts(p, n, n))
    }
}

/// Whether this thread can run a batch in place (a multi-threaded runtime).
pub fn available() -> bool {
    Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread)
}

/// A tensor to load and the buffer it goes into.
pub type Target<'a> = (&'a TensorRecord, &'a mut [u8]);

/// The tensors' slices of one packed chunk: (offset in the chunk, buffer).
type Members<'a> = Vec<(usize, &'a mut [u8])>;

/// Split each target into chunk jobs; a packed chunk is one job for all the
/// tensors it holds. Targets of other layouts are returned apart.
fn plan<'a>(targets: Vec<Target<'a>>) -> Result<(Vec<Job<'a>>, Vec<Target<'a>>)> {
    let mut jobs: Vec<Job<'a>> = Vec::new();
    let mut packs: HashMap<&'a str, usize> = HashMap::new();
    let mut other = Vec::new();
    for (record, dst) in targets {
        let Layout::Chunks { chunks } = &record.layout else {
            other.push((record, dst));
            continue;
        };
        let corrupt = |why: &str| Error::corrupt("manifest", Some(&record.name), why);
        let mut rest = dst;
        for c in chunks {
            let len = usize::try_from(c.len).map_err(|_| corrupt("chunk too large"))?;
            if len > rest.len() {
                return Err(corrupt("chunks exceed the tensor"));
            }
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            match c.offset {
                None => jobs.push(Job {
                    hash: &c.hash,
                    tensor: &record.name,
                    dst: Dst::Whole(head),
                }),
                Some(offset) => {
                    let offset =
                        usize::try_from(offset).map_err(|_| corrupt("offset too large"))?;
                    let at = *packs.entry(c.hash.as_str()).or_insert_with(|| {
                        jobs.push(Job {
                            hash: &c.hash,
                            tensor: &record.name,
                            dst: Dst::Packed(Vec::new()),
                        });
                        jobs.len() - 1
                    });
                    if let Dst::Packed(members) = &mut jobs[at].dst {
                        members.push((offset, head));
                    }
                }
            }
        }
        if !rest.is_empty() {
            return Err(corrupt("chunks do not cover the tensor"));
        }
    }
    Ok((jobs, other))
}

/// Read the chunked targets into their buffers (see the module docs) and hand
/// back the targets of other layouts. Call only where [`available`] says so.
pub async fn read_many_into<'a>(
    ctx: &ReadContext,
    targets: Vec<Target<'a>>,
) -> Result<Vec<Target<'a>>> {
    read_in_windows(ctx, targets, WINDOW_BYTES).await
}

async fn read_in_windows<'a>(
    ctx: &ReadContext,
    targets: Vec<Target<'a>>,
    window_bytes: u64,
) -> Result<Vec<Target<'a>>> {
    let (jobs, other) = plan(targets)?;
    let handle = Handle::current();
    let mut jobs = jobs.into_iter().peekable();
    while jobs.peek().is_some() {
        let (mut window, mut bytes) = (Vec::new(), 0u64);
        while let Some(job) = jobs.next_if(|_| bytes < window_bytes) {
            bytes += job.bytes();
            window.push(job);
        }
        // The threads are the bound on this load's reads: they take none of the
        // context's fetch permits, which a future of this task that is not
        // polled meanwhile could be holding.
        let workers = ctx.concurrency.clamp(1, window.len());
        tokio::task::block_in_place(|| run_window(ctx, &handle, window, workers))?;
        tokio::task::yield_now().await;
    }
    Ok(other)
}

/// Run the jobs of one window on `workers` scoped threads; the first error wins.
fn run_window(
    ctx: &ReadContext,
    handle: &Handle,
    jobs: Vec<Job<'_>>,
    workers: usize,
) -> Result<()> {
    let queue = Mutex::new(jobs.into_iter());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                if failed.lock_unpoisoned().is_some() {
                    break;
                }
                let next = queue.lock_unpoisoned().next();
                let Some(job) = next else { break };
                let tensor = job.tensor;
                if let Err(e) = run_job(ctx, handle, job) {
                    failed
                        .lock_unpoisoned()
                        .get_or_insert(e.with_tensor(tensor));
                    break;
                }
            });
        }
    });
    match ckpt_core::sync::unpoisoned(failed.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Fetch one chunk and fill its destination, verified.
fn run_job(ctx: &ReadContext, handle: &Handle, job: Job<'_>) -> Result<()> {
    let Job { hash, tensor, dst } = job;
    let key = chunk_key(hash);
    let damaged = |e: CodecError| {
        ctx.chunks.remove(hash);
        e.into_corrupt(key.as_ref(), Some(tensor))
    };
    let got = handle
        .block_on(ctx.store.get(&key))
        .map_err(|e| storage_err(e, key.as_ref(), tensor))?;
    let object_store::GetResult {
        payload,
        meta,
        range,
        attributes,
        extensions,
    } = got;
    let stored = match (payload, dst) {
        (GetResultPayload::File(file, _), Dst::Whole(dst)) => {
            return whole_from_file(handle, &file, meta.size, hash, dst, &damaged)
        }
        (GetResultPayload::File(file, _), Dst::Packed(members)) => {
            match packed_from_file(handle, &file, meta.size, hash, members, &damaged)? {
                None => return Ok(()),
                Some(members) => (read_file(&file, meta.size, &damaged)?, Dst::Packed(members)),
            }
        }
        (payload, dst) => {
            let got = object_store::GetResult {
                payload,
                meta,
                range,
                attributes,
                extensions,
            };
            let bytes = handle
                .block_on(got.bytes())
                .map_err(|e| storage_err(e, key.as_ref(), tensor))?;
            (bytes, dst)
        }
    };
    let (stored, dst) = stored;
    let _cpu = handle.block_on(ckpt_core::budget::cpu_permit())?;
    match dst {
        Dst::Whole(dst) => chunk::decode_into(&stored, hash, dst).map_err(damaged),
        Dst::Packed(members) => {
            let raw = chunk::decode(stored, hash, MAX_CHUNK_BYTES).map_err(damaged)?;
            for (offset, d) in members {
                let src = offset
                    .checked_add(d.len())
                    .and_then(|end| raw.get(offset..end))
                    .ok_or_else(|| {
                        damaged(CodecError::Truncated(format!(
                            "slice {offset}+{} is outside the chunk of {} bytes",
                            d.len(),
                            raw.len()
                        )))
                    })?;
                d.copy_from_slice(src);
            }
            Ok(())
        }
    }
}

/// A whole chunk of a local file into `dst`: a raw one read straight into it
/// and hashed there, a compressed one read and decoded into it.
fn whole_from_file(
    handle: &Handle,
    file: &File,
    size: u64,
    hash: &str,
    dst: &mut [u8],
    damaged: &dyn Fn(CodecError) -> Error,
) -> Result<()> {
    let head = read_header(file, size, damaged)?;
    if !head.is_raw() {
        let stored = read_file(file, size, damaged)?;
        let _cpu = handle.block_on(ckpt_core::budget::cpu_permit())?;
        return chunk::decode_into(&stored, hash, dst).map_err(damaged);
    }
    let raw = head.raw_len;
    let expect = head.len as u64 + dst.len() as u64;
    if raw != dst.len() as u64 || size != expect {
        return Err(damaged(CodecError::Truncated(format!(
            "{size} bytes stored claiming {raw} raw bytes; the tensor's chunk has {} ({expect} stored)",
            dst.len()
        ))));
    }
    read_at(file, dst, head.len as u64, size, damaged)?;
    let _cpu = handle.block_on(ckpt_core::budget::cpu_permit())?;
    chunk::verify(dst, hash).map_err(damaged)
}

/// A raw packed chunk of a local file whose members cover it exactly (a whole
/// state loaded in place), read straight into the members in chunk order and
/// hashed there. Anything else (compressed, or only some of its tensors
/// wanted) hands the members back for the buffered path.
fn packed_from_file<'a>(
    handle: &Handle,
    file: &File,
    size: u64,
    hash: &str,
    mut members: Members<'a>,
    damaged: &dyn Fn(CodecError) -> Error,
) -> Result<Option<Members<'a>>> {
    let head = read_header(file, size, damaged)?;
    if !head.is_raw() {
        return Ok(Some(members));
    }
    let raw = head.raw_len;
    members.sort_by_key(|(offset, _)| *offset);
    let mut end = 0u64;
    for (offset, d) in &members {
        if *offset as u64 != end {
            return Ok(Some(members));
        }
        end += d.len() as u64;
    }
    if end != raw {
        return Ok(Some(members));
    }
    let expect = head.len as u64 + raw;
    if size != expect {
        return Err(damaged(CodecError::Truncated(format!(
            "{size} bytes stored claiming {raw} raw bytes ({expect} stored)"
        ))));
    }
    for (offset, d) in members.iter_mut() {
        read_at(file, d, (head.len + *offset) as u64, size, damaged)?;
    }
    let _cpu = handle.block_on(ckpt_core::budget::cpu_permit())?;
    let parts: Vec<&[u8]> = members.iter().map(|(_, d)| &**d).collect();
    chunk::verify_parts(&parts, hash).map_err(damaged)?;
    Ok(None)
}

/// The header of a stored chunk of `size` bytes (its first
/// [`chunk::HEADER_LEN`] bytes, or all of a shorter one), checked.
fn read_header(
    file: &File,
    size: u64,
    damaged: &dyn Fn(CodecError) -> Error,
) -> Result<chunk::Header> {
    let mut head = [0u8; chunk::HEADER_LEN];
    let n = size.min(chunk::HEADER_LEN as u64) as usize;
    read_at(file, &mut head[..n], 0, size, damaged)?;
    chunk::header(&head[..n]).map_err(damaged)
}

/// A whole stored chunk of `size` bytes (at most a chunk's header and payload).
fn read_file(file: &File, size: u64, damaged: &dyn Fn(CodecError) -> Error) -> Result<Bytes> {
    let len = usize::try_from(size)
        .ok()
        .filter(|&l| l <= chunk::HEADER_LEN + MAX_CHUNK_BYTES)
        .ok_or_else(|| damaged(CodecError::TooLarge(format!("{size} bytes stored"))))?;
    let mut buf = vec![0u8; len];
    read_at(file, &mut buf, 0, size, damaged)?;
    Ok(Bytes::from(buf))
}

/// `pread` exactly `buf.len()` bytes at `offset` of a file of `size` bytes. A
/// file shorter than that (now or when it was opened) is a truncated chunk;
/// any other failure is the disk's.
fn read_at(
    file: &File,
    buf: &mut [u8],
    offset: u64,
    size: u64,
    damaged: &dyn Fn(CodecError) -> Error,
) -> Result<()> {
    let end = offset + buf.len() as u64;
    if end > size {
        return Err(damaged(CodecError::Truncated(format!(
            "{size} bytes, shorter than the {end} needed"
        ))));
    }
    file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => damaged(CodecError::Truncated(format!(
            "the file ends before byte {end}"
        ))),
        _ => Error::Io(e),
    })
}

#[cfg(test)]
mod tests {

    use ckpt_core::{CheckpointerOptions, Compression, DType, Manifest, State, Tensor};

    use super::*;

    /// Big tensors split over several chunks, small ones packed, one mid-sized
    /// one in a chunk of its own, and an empty one; compressible when `zstd`.
    fn state(zstd: bool) -> State {
        let sizes = [
            (300_000usize, "big"),
            (4_000, "small1"),
            (8_000, "small2"),
            (20_000, "mid"),
            (0, "empty"),
        ];
        sizes
            .iter()
            .enumerate()
            .fold(State::new(), |s, (i, (n, name))| {
                let data: Vec<u8> = (0..*n)
                    .map(|j| {
                        if zstd {
                            (j / 64 % 7) as u8
                        } else {
                            (j * 31 + i * 7 + j / 251) as u8
                        }
                    })
                    .collect();
                s.with_tensor(Tensor::new(*name, DType::U8, vec![*n as u64], data).unwrap())
            })
    }

    async fn saved(url: &str, zstd: bool) -> (Manifest, State) {
        let mut opts = CheckpointerOptions::default();
        opts.write.chunk_size = 64 << 10;
        let comp = if zstd {
            Compression::Zstd(1)
        } else {
            Compression::None
        };
        let cp = crate::builder(url)
            .options(opts)
            .compression(comp)
            .build()
            .await
            .unwrap();
        let st = state(zstd);
        cp.save(1, &st).await.unwrap().wait().await.unwrap();
        let id = cp.committed().await.unwrap().pop().unwrap();
        (cp.manifest(&id).await.unwrap(), st)
    }

    fn ctx(url: &str) -> ReadContext {
        ReadContext::new(ckpt_core::store::open_url(url).unwrap(), 4)
    }

    /// Read every tensor of `m` with windows of `window` bytes and compare.
    async fn check(url: &str, m: &Manifest, st: &State, window: u64) -> Result<()> {
        let mut bufs: Vec<Vec<u8>> = st
            .tensors
            .iter()
            .map(|t| vec![0xA5; t.data.len()])
            .collect();
        let targets = m
            .tensors
            .iter()
            .zip(bufs.iter_mut())
            .map(|(r, b)| (r, b.as_mut_slice()))
            .collect();
        let rest = read_in_windows(&ctx(url), targets, window).await?;
        assert!(rest.is_empty());
        for (t, b) in st.tensors.iter().zip(&bufs) {
            assert_eq!(&t.data[..], &b[..], "{}", t.name);
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_kind_of_chunk_from_files_and_streams() {
        assert!(available());
        for zstd in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let file = format!("file://{}", dir.path().display());
            let memory = format!("memory://batch-{zstd}");
            for url in [&file, &memory] {
                let (m, st) = saved(url, zstd).await;
                let Layout::Chunks { chunks } = &m.tensors[0].layout else {
                    panic!("chunked")
                };
                assert!(chunks.len() > 1, "the big tensor spans chunks");
                assert!(m.tensors.iter().any(|t| matches!(&t.layout, Layout::Chunks { chunks } if chunks.iter().any(|c| c.offset.is_some()))));
                for window in [1, 100_000, u64::MAX] {
                    check(url, &m, &st, window).await.unwrap();
                }
                // Into new buffers (a load that returns the state): the same batch.
                let got = ckpt_core::Format::read_many(
                    &super::super::Native,
                    &ctx(url),
                    m.tensors.iter().collect(),
                )
                .await
                .unwrap();
                for (t, b) in st.tensors.iter().zip(&got) {
                    assert_eq!(&t.data[..], &b[..], "{}", t.name);
                }
            }
        }
    }

    /// Something done to a stored file.
    type Damage = dyn Fn(&std::path::Path);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn damaged_chunks_are_corrupt_and_name_their_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let (m, st) = saved(&url, false).await;
        let chunk_of = |i: usize| match &m.tensors[i].layout {
            Layout::Chunks { chunks } => chunks[0].hash.clone(),
            _ => panic!("chunked"),
        };
        // A flipped byte (the big tensor's first chunk, then the packed small
        // tensors' chunk, read straight into them), a truncated file (the
        // packed chunk), and a missing one (the mid-sized tensor).
        let flip: &Damage = &|p| {
            let mut b = std::fs::read(p).unwrap();
            b[100] ^= 1;
            std::fs::write(p, b).unwrap();
        };
        let cases: [(usize, &Damage); 4] = [
            (0, flip),
            (1, flip),
            (1, &|p| {
                let b = std::fs::read(p).unwrap();
                std::fs::write(p, &b[..b.len() - 3]).unwrap();
            }),
            (3, &|p| std::fs::remove_file(p).unwrap()),
        ];
        for (i, damage) in cases {
            let hash = chunk_of(i);
            let path = dir.path().join("chunks").join(&hash);
            let good = std::fs::read(&path).unwrap();
            damage(&path);
            match check(&url, &m, &st, u64::MAX).await {
                Err(Error::Corrupt { object, tensor, .. }) => {
                    assert_eq!(object, format!("chunks/{hash}"));
                    assert_eq!(tensor.as_deref(), Some(m.tensors[i].name.as_str()));
                }
                other => panic!("tensor {i}: expected Corrupt, got {other:?}"),
            }
            std::fs::write(&path, good).unwrap();
            check(&url, &m, &st, u64::MAX).await.unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn some_tensors_of_a_packed_chunk_are_read_and_verified() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let (m, st) = saved(&url, false).await;
        let at = m.tensors.iter().position(|t| t.name == "small2").unwrap();
        let hash = match &m.tensors[at].layout {
            Layout::Chunks { chunks } => {
                assert!(chunks[0].offset.is_some(), "small2 is packed");
                chunks[0].hash.clone()
            }
            _ => panic!("chunked"),
        };
        let read_small2 = || async {
            let mut buf = vec![0xA5; st.tensors[at].data.len()];
            let rest = read_in_windows(
                &ctx(&url),
                vec![(&m.tensors[at], buf.as_mut_slice())],
                u64::MAX,
            )
            .await?;
            assert!(rest.is_empty());
            Ok::<_, Error>(buf)
        };
        assert_eq!(&read_small2().await.unwrap()[..], &st.tensors[at].data[..]);
        // Its chunk damaged where another tensor's bytes lie: still caught.
        let path = dir.path().join("chunks").join(&hash);
        let mut b = std::fs::read(&path).unwrap();
        b[chunk::HEADER_LEN] ^= 1;
        std::fs::write(&path, b).unwrap();
        match read_small2().await {
            Err(Error::Corrupt { object, tensor, .. }) => {
                assert_eq!(object, format!("chunks/{hash}"));
                assert_eq!(tensor.as_deref(), Some("small2"));
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }

    /// A stored chunk rewritten as chunks were written before the header grew
    /// to 64 bytes: magic `CKC1`, the payload right after the first 16 bytes.
    fn as_v1(p: &std::path::Path) {
        let b = std::fs::read(p).unwrap();
        assert_eq!(&b[..4], b"CKC2");
        assert!(b[chunk::V1_HEADER_LEN..chunk::HEADER_LEN]
            .iter()
            .all(|&x| x == 0));
        let mut v1 = b[..chunk::V1_HEADER_LEN].to_vec();
        v1[..4].copy_from_slice(b"CKC1");
        v1.extend_from_slice(&b[chunk::HEADER_LEN..]);
        std::fs::write(p, v1).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_with_the_earlier_16_byte_header_still_load() {
        for zstd in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("file://{}", dir.path().display());
            let (m, st) = saved(&url, zstd).await;
            for e in std::fs::read_dir(dir.path().join("chunks")).unwrap() {
                as_v1(&e.unwrap().path());
            }
            // In place (raw chunks whole and packed, or decoded), into new
            // buffers, and one tensor of a packed chunk (through a buffer).
            check(&url, &m, &st, u64::MAX).await.unwrap();
            let got = ckpt_core::Format::read_many(
                &super::super::Native,
                &ctx(&url),
                m.tensors.iter().collect(),
            )
            .await
            .unwrap();
            for (t, b) in st.tensors.iter().zip(&got) {
                assert_eq!(&t.data[..], &b[..], "{}", t.name);
            }
            let at = m.tensors.iter().position(|t| t.name == "small2").unwrap();
            let mut one = vec![0xA5; st.tensors[at].data.len()];
            let targets = vec![(&m.tensors[at], one.as_mut_slice())];
            read_in_windows(&ctx(&url), targets, u64::MAX)
                .await
                .unwrap();
            assert_eq!(&one[..], &st.tensors[at].data[..]);
        }
    }

    #[tokio::test]
    async fn a_one_thread_runtime_has_no_batch() {
        assert!(!available());
    }
}
