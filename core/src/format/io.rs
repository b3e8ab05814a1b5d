//! Building blocks for [`Format`] implementations: the object writes and
//! verified reads every format shares, and the default read paths of the
//! trait.
//!
//! Reads hold a turn of the load's read limit ([`ReadContext::fetches`]) while
//! their bytes are in flight; writes count themselves in the save's
//! [`WriteStats`](crate::format::WriteStats).

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

use crate::error::{Error, Result};
use crate::format::{Format, ReadContext, WriteContext};
use crate::layout::manifest::{Layout, TensorRecord};

/// [`Format::read`] on each record, [`ReadContext::tensors_in_flight`] at
/// once, results in order.
pub async fn read_each<F: Format + ?Sized>(
    format: &F,
    ctx: &ReadContext,
    records: Vec<&TensorRecord>,
) -> Result<Vec<Bytes>> {
    let reads: Vec<_> = records
        .into_iter()
        .map(|r| async move {
            format
                .read(ctx, r)
                .await
                .map_err(|e| e.with_tensor(&r.name))
        })
        .collect();
    futures::stream::iter(reads)
        .buffered(ctx.tensors_in_flight.max(1))
        .try_collect()
        .await
}

/// [`Format::read_into`] on each target, [`ReadContext::tensors_in_flight`]
/// at once: the storage
/// always has reads queued (bounded by [`ReadContext::fetches`]), even while a
/// run of small tensors waits on the one packed chunk they share.
pub async fn read_each_into<F: Format + ?Sized>(
    format: &F,
    ctx: &ReadContext,
    targets: Vec<(&TensorRecord, &mut [u8])>,
) -> Result<()> {
    let reads: Vec<_> = targets
        .into_iter()
        .map(|(r, dst)| async move {
            format
                .read_into(ctx, r, dst)
                .await
                .map_err(|e| e.with_tensor(&r.name))
        })
        .collect();
    futures::stream::iter(reads)
        .buffer_unordered(ctx.tensors_in_flight.max(1))
        .try_collect::<Vec<()>>()
        .await
        .map(drop)
}

/// Read a [`Layout::Range`] tensor and verify its blake3.
pub async fn read_range(ctx: &ReadContext, record: &TensorRecord) -> Result<Bytes> {
    let Layout::Range {
        object,
        offset,
        len,
        blake3: want,
    } = &record.layout
    else {
        return Err(Error::Unsupported(format!(
            "tensor `{}`: this format cannot read a chunked layout",
            record.name
        )));
    };
    let end = offset
        .checked_add(*len)
        .ok_or_else(|| Error::corrupt(object.as_str(), Some(&record.name), "range overflows"))?;
    let _permit = ctx.fetch_permit().await?;
    let data = if *len == 0 {
        ctx.store
            .head(&Path::from(object.as_str()))
            .await
            .map_err(|e| storage_err(e, object, &record.name))?;
        Bytes::new()
    } else {
        match ctx
            .store
            .get_range(&Path::from(object.as_str()), *offset..end)
            .await
        {
            Ok(b) => b,
            Err(e) => return Err(range_error(ctx, e, object, &record.name, end).await),
        }
    };
    if data.len() as u64 != *len {
        return Err(Error::corrupt(
            object.as_str(),
            Some(&record.name),
            format!("object is truncated: got {} of {len} bytes", data.len()),
        ));
    }
    let data2 = data.clone();
    let got = crate::budget::run_cpu(move || blake3::hash(&data2)).await?;
    if got.to_hex().as_str() != want {
        return Err(Error::corrupt(
            object.as_str(),
            Some(&record.name),
            "blake3 mismatch",
        ));
    }
    Ok(data)
}

/// Map a storage error on a known object to a typed ckpt error: a missing object
/// is corruption of the checkpoint, anything else a storage failure (which
/// `load_latest` does not skip past). Truncation is detected by length checks
/// and by [`range_error`], never by an error message.
pub fn storage_err(e: object_store::Error, object: &str, tensor: &str) -> Error {
    match e {
        object_store::Error::NotFound { .. } => {
            Error::corrupt(object, Some(tensor), "object is missing")
        }
        other => Error::Storage(other),
    }
}

/// A ranged read failed: if the object is now shorter than the range, it was
/// truncated (corruption); otherwise the error is the store's.
async fn range_error(
    ctx: &ReadContext,
    e: object_store::Error,
    object: &str,
    tensor: &str,
    end: u64,
) -> Error {
    if matches!(e, object_store::Error::NotFound { .. }) {
        return storage_err(e, object, tensor);
    }
    match ctx.store.head(&Path::from(object)).await {
        Ok(meta) if meta.size < end => Error::corrupt(
            object,
            Some(tensor),
            format!(
                "object is truncated: {} bytes, the tensor ends at {end}",
                meta.size
            ),
        ),
        _ => Error::Storage(e),
    }
}

/// Write one object, in parts when it is large. The parts are sent as they are (no copy).
pub async fn put_object(ctx: &WriteContext, key: &Path, parts: Vec<Bytes>) -> Result<u64> {
    let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
    let start = std::time::Instant::now();
    if total as usize > ctx.options.multipart_threshold {
        let upload = ctx.store.put_multipart(key).await?;
        let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, 16 << 20);
        for p in parts {
            w.wait_for_capacity(ctx.options.concurrency.max(1)).await?;
            w.put(p);
        }
        w.finish().await?;
    } else {
        ctx.store.put(key, PutPayload::from_iter(parts)).await?;
    }
    ctx.stats.add_stored(total, start.elapsed());
    crate::failpoint::hit("save.mid_data").await?;
    Ok(total)
}
