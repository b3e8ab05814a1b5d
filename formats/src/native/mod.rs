//! The native format: tensors split into content-addressed chunks, each
//! optionally zstd-compressed and named by the blake3 hash of its raw bytes.
//!
//! Chunks live under `chunks/<hash>` and are shared by every checkpoint under the
//! root, so a chunk that did not change since an earlier checkpoint is not written
//! again. Loading one tensor reads only its chunks.
//!
//! Writing is a pipeline: each chunk is hashed on a blocking thread, compared with
//! the chunks already stored, compressed if asked, and uploaded, with at most
//! `concurrency` chunks in flight, so hashing overlaps writing.

pub mod batch;
pub mod chunk;
pub mod pack;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ckpt_core::format::io::{put_object, storage_err};
use ckpt_core::layout::chunk_key;
use ckpt_core::{
    ChunkRef, Compression, Error, Format, Layout, ReadContext, Result, Tensor, TensorRecord,
    WriteContext, WriteOutput, MAX_CHUNK_BYTES,
};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::ObjectStoreExt;

/// The native chunked format.
#[derive(Debug, Clone, Default)]
pub struct Native;

type Pending = Shared<BoxFuture<'static, std::result::Result<u64, Arc<Error>>>>;

// CPU work (hashing, zstd, verification) runs within the process's CPU budget.
use ckpt_core::budget::run_cpu as blocking;
use ckpt_core::sync::MutexExt;

/// Hash, dedupe, compress and upload one chunk, given as its raw parts in
/// order; returns its reference.
async fn write_chunk(
    ctx: &WriteContext,
    parts: Vec<Bytes>,
    inflight: &Mutex<HashMap<String, Pending>>,
) -> Result<ChunkRef> {
    let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let t = Instant::now();
    let d = parts.clone();
    let hash = blocking(move || chunk::hash_parts(&d)).await?;
    ctx.stats.add_hash_time(t.elapsed());
    ctx.stats.add_raw(len);

    if let Some(stored) = ctx.chunks.get(&hash) {
        ctx.stats.add_reused(len);
        return Ok(ChunkRef {
            hash,
            len,
            stored,
            offset: None,
        });
    }
    // The same content twice in one save: the first writer uploads, the rest wait for it.
    let (fut, first) = {
        let mut map = inflight.lock_unpoisoned();
        match map.get(&hash) {
            Some(f) => (f.clone(), false),
            None => {
                let ctx2 = ctx.clone();
                let h = hash.clone();
                let f = async move { upload(&ctx2, &h, parts).await.map_err(Arc::new) }
                    .boxed()
                    .shared();
                map.insert(hash.clone(), f.clone());
                (f, true)
            }
        }
    };
    // The upload's own error (a full disk stays a storage error), once per waiter.
    let stored = fut.await.map_err(|e| e.duplicate())?;
    if first {
        ctx.chunks.insert(hash.clone(), stored);
    } else {
        ctx.stats.add_reused(len);
    }
    Ok(ChunkRef {
        hash,
        len,
        stored,
        offset: None,
    })
}

async fn upload(ctx: &WriteContext, hash: &str, parts: Vec<Bytes>) -> Result<u64> {
    let compression = ctx.options.compression;
    let t = Instant::now();
    let enc = if compression == Compression::None {
        chunk::encode(&parts, compression)
    } else {
        blocking(move || chunk::encode(&parts, compression)).await?
    }
    .map_err(|e| Error::Internal(format!("encode chunk: {e}")))?;
    ctx.stats.add_encode_time(t.elapsed());
    put_object(ctx, &chunk_key(hash), enc.parts()).await
}

#[async_trait]
impl Format for Native {
    fn name(&self) -> &'static str {
        "native"
    }

    async fn write(&self, ctx: &WriteContext, tensors: &[Tensor]) -> Result<WriteOutput> {
        let size = ctx.options.chunk_size.clamp(1, MAX_CHUNK_BYTES);
        let pieces = pack::plan(tensors, size);
        // Pieces over the very same memory (the chunks of a weight tied
        // between two tensors, which the snapshot staged once) are the same
        // bytes: hashed and written once.
        let mut first_of: HashMap<Vec<(usize, usize)>, usize> = HashMap::new();
        let same_as: Vec<Option<usize>> = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let span = p.parts.iter().map(|b| (b.as_ptr() as usize, b.len()));
                match first_of.entry(span.collect()) {
                    std::collections::hash_map::Entry::Occupied(e) => Some(*e.get()),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(i);
                        None
                    }
                }
            })
            .collect();
        let inflight = Mutex::new(HashMap::new());
        let unique = (0..pieces.len()).filter(|&i| same_as[i].is_none());
        let firsts: Vec<(usize, ChunkRef)> = futures::stream::iter(unique)
            .map(|i| {
                let (inflight, parts) = (&inflight, pieces[i].parts.clone());
                async move { write_chunk(ctx, parts, inflight).await.map(|r| (i, r)) }
            })
            .buffered(ctx.options.concurrency.max(1))
            .try_collect()
            .await?;
        let mut refs: Vec<Option<ChunkRef>> = vec![None; pieces.len()];
        for (i, r) in firsts {
            refs[i] = Some(r);
        }
        for (i, first) in same_as.iter().enumerate() {
            if let Some(f) = *first {
                refs[i] = refs[f].clone();
                let len = pieces[i].len() as u64;
                ctx.stats.add_raw(len);
                ctx.stats.add_reused(len);
            }
        }
        let written = pieces.into_iter().zip(refs).map(|(p, r)| {
            r.map(|r| (p, r))
                .ok_or_else(|| Error::Internal("a chunk was not written".into()))
        });
        let written: Vec<(pack::Piece, ChunkRef)> = written.collect::<Result<_>>()?;
        let refs = written.into_iter().flat_map(|(p, r)| {
            p.members.into_iter().map(move |m| {
                let mut r = r.clone();
                r.len = m.len as u64;
                r.offset = p.packed.then_some(m.offset as u64);
                (m.tensor, r)
            })
        });
        let mut per_tensor: Vec<Vec<ChunkRef>> = vec![Vec::new(); tensors.len()];
        for (i, r) in refs {
            per_tensor[i].push(r);
        }
        let records = tensors
            .iter()
            .zip(per_tensor)
            .map(|(t, chunks)| TensorRecord {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                shard: t.shard.clone(),
                layout: Layout::Chunks { chunks },
            })
            .collect();
        Ok(WriteOutput {
            records,
            objects: Vec::new(),
        })
    }

    async fn read(&self, ctx: &ReadContext, record: &TensorRecord) -> Result<Bytes> {
        let Layout::Chunks { chunks } = &record.layout else {
            return ckpt_core::format::io::read_range(ctx, record).await;
        };
        let reads: Vec<_> = chunks
            .iter()
            .map(|c| read_ref(ctx, c, &record.name))
            .collect();
        let parts: Vec<Bytes> = futures::stream::iter(reads)
            .buffered(ctx.concurrency.max(1))
            .try_collect()
            .await?;
        Ok(match parts.len() {
            0 => Bytes::new(),
            1 => parts.into_iter().next().expect("one part"),
            _ => {
                let mut out = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
                for p in parts {
                    out.extend_from_slice(&p);
                }
                out.freeze()
            }
        })
    }

    async fn read_into(
        &self,
        ctx: &ReadContext,
        record: &TensorRecord,
        dst: &mut [u8],
    ) -> Result<()> {
        let Layout::Chunks { chunks } = &record.layout else {
            let data = ckpt_core::format::io::read_range(ctx, record).await?;
            dst.copy_from_slice(&data);
            return Ok(());
        };
        // Split the destination into one disjoint slice per chunk.
        let mut rest = dst;
        let mut reads = Vec::with_capacity(chunks.len());
        for c in chunks {
            let len = usize::try_from(c.len)
                .map_err(|_| Error::corrupt("manifest", Some(&record.name), "chunk too large"))?;
            if len > rest.len() {
                return Err(Error::corrupt(
                    "manifest",
                    Some(&record.name),
                    "chunks exceed the tensor",
                ));
            }
            let (head, tail) = rest.split_at_mut(len);
            rest = tail;
            reads.push(async move {
                match c.offset {
                    None => read_chunk_into(ctx, c, &record.name, head).await,
                    Some(_) => {
                        head.copy_from_slice(&read_ref(ctx, c, &record.name).await?);
                        Ok(())
                    }
                }
            });
        }
        futures::stream::iter(reads)
            .buffer_unordered(ctx.concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    async fn read_many_into(
        &self,
        ctx: &ReadContext,
        targets: Vec<(&TensorRecord, &mut [u8])>,
    ) -> Result<()> {
        let rest = if batch::available() {
            batch::read_many_into(ctx, targets).await?
        } else {
            targets
        };
        ckpt_core::format::io::read_each_into(self, ctx, rest).await
    }

    async fn read_many(
        &self,
        ctx: &ReadContext,
        records: Vec<&TensorRecord>,
    ) -> Result<Vec<Bytes>> {
        if !batch::available() {
            return ckpt_core::format::io::read_each(self, ctx, records).await;
        }
        // New buffers of each tensor's length, filled by one planned batch.
        let mut bufs = records
            .iter()
            .map(|r| batch::zeroed(r))
            .collect::<Result<Vec<_>>>()?;
        let targets = records
            .iter()
            .copied()
            .zip(bufs.iter_mut().map(Vec::as_mut_slice))
            .collect();
        self.read_many_into(ctx, targets).await?;
        Ok(bufs.into_iter().map(Bytes::from).collect())
    }
}

/// Fetch a chunk, decode it into `dst` and verify it.
async fn read_chunk_into(
    ctx: &ReadContext,
    c: &ChunkRef,
    tensor: &str,
    dst: &mut [u8],
) -> Result<()> {
    let _permit = ctx.fetch_permit().await?;
    let (key, stored) = fetch_chunk(ctx, &c.hash, tensor).await?;
    let damaged = |e: crate::error::CodecError| {
        ctx.chunks.remove(&c.hash);
        e.into_corrupt(key.as_ref(), Some(tensor))
    };
    match chunk::raw_payload(&stored, dst.len()).map_err(damaged)? {
        // A raw chunk (the default): its hash is checked on a blocking thread (the
        // payload is owned there) while this task copies it into the destination,
        // so the chunks of a load are hashed on every core, not on this one.
        Some(payload) => {
            let (p, h) = (payload.clone(), c.hash.clone());
            let check = tokio::spawn(blocking(move || chunk::verify(&p, &h)));
            dst.copy_from_slice(&payload);
            check
                .await
                .map_err(|e| Error::Internal(format!("worker thread: {e}")))??
                .map_err(damaged)
        }
        // Compressed: decoded on this task, straight into the borrowed destination
        // (a blocking thread would need an owned copy, which `load_into` avoids).
        None => chunk::decode_into(&stored, &c.hash, dst).map_err(damaged),
    }
}

/// A tensor's bytes in one chunk: the whole chunk, or its slice of a packed chunk
/// (fetched and verified once per load, whichever tensor asks first).
async fn read_ref(ctx: &ReadContext, c: &ChunkRef, tensor: &str) -> Result<Bytes> {
    let Some(offset) = c.offset else {
        return read_chunk(ctx, c, tensor).await;
    };
    let (ctx2, hash, name) = (ctx.clone(), c.hash.clone(), tensor.to_owned());
    let whole = ctx
        .cache
        .get_or_load(&c.hash, async move {
            read_whole(&ctx2, &hash, &name, None).await
        })
        .await?;
    let range = usize::try_from(offset)
        .ok()
        .zip(usize::try_from(c.len).ok())
        .and_then(|(o, l)| Some(o..o.checked_add(l)?))
        .filter(|r| r.end <= whole.len())
        .ok_or_else(|| {
            Error::corrupt(
                chunk_key(&c.hash).as_ref(),
                Some(tensor),
                format!(
                    "slice {offset}+{} is outside the chunk of {} bytes",
                    c.len,
                    whole.len()
                ),
            )
        })?;
    Ok(whole.slice(range))
}

/// The stored bytes of a chunk, and its key.
async fn fetch_chunk(ctx: &ReadContext, hash: &str, tensor: &str) -> Result<(Path, Bytes)> {
    let key = chunk_key(hash);
    let stored = match ctx.store.get(&key).await {
        Ok(r) => r
            .bytes()
            .await
            .map_err(|e| storage_err(e, key.as_ref(), tensor))?,
        Err(e) => return Err(storage_err(e, key.as_ref(), tensor)),
    };
    Ok((key, stored))
}

async fn read_chunk(ctx: &ReadContext, c: &ChunkRef, tensor: &str) -> Result<Bytes> {
    read_whole(ctx, &c.hash, tensor, Some(c.len)).await
}

/// Fetch, decode and verify a whole chunk; `expect` is its raw length when known.
async fn read_whole(
    ctx: &ReadContext,
    hash: &str,
    tensor: &str,
    expect: Option<u64>,
) -> Result<Bytes> {
    let _permit = ctx.fetch_permit().await?;
    let (key, stored) = fetch_chunk(ctx, hash, tensor).await?;
    let h = hash.to_owned();
    let max = expect.map_or(MAX_CHUNK_BYTES, |l| {
        usize::try_from(l)
            .unwrap_or(usize::MAX)
            .min(MAX_CHUNK_BYTES)
    });
    let raw = blocking(move || chunk::decode(stored, &h, max)).await?;
    match raw {
        Ok(raw) if expect.is_none_or(|l| raw.len() as u64 == l) => Ok(raw),
        Ok(raw) => {
            ctx.chunks.remove(hash);
            Err(Error::corrupt(
                key.as_ref(),
                Some(tensor),
                format!(
                    "chunk has {} bytes, manifest says {}",
                    raw.len(),
                    expect.unwrap_or(0)
                ),
            ))
        }
        Err(e) => {
            // Forget it, so the next save writes a good copy instead of reusing this one.
            ctx.chunks.remove(hash);
            Err(e.into_corrupt(key.as_ref(), Some(tensor)))
        }
    }
}
