//! A restricted pickle writer (protocol 2, the opcodes `torch.load(weights_only=True)`
//! accepts): plain data ([`Value`]) and tensors, nothing else.
//!
//! A tensor is written as `torch.save` writes it: a rebuild call whose first argument
//! is a persistent storage id `('storage', <storage type>, key, 'cpu', numel)`; the
//! storage bytes are the zip record `data/<key>`. A tensor referenced twice is
//! written once and memoized, so Python gets back one shared object.

use std::collections::HashMap;

use ckpt_core::{Key, Tensor, Value};

use crate::error::CodecError;
use crate::torch::dtypes;

/// Deepest [`Value`] nesting the writer accepts.
pub const MAX_DEPTH: usize = 512;

/// Where a tensor's bytes go: the storage record key.
#[derive(Debug, Clone)]
pub struct Slot<'a> {
    /// Record key (`0`, `1`, ...).
    pub key: String,
    /// The tensor.
    pub tensor: &'a Tensor,
}

struct Writer<'a> {
    out: Vec<u8>,
    tensors: &'a HashMap<&'a str, Slot<'a>>,
    memo: HashMap<&'a str, u32>,
}

/// Contiguous (row-major) strides, as torch computes them (zero-size dims count as 1).
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc: u64 = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    strides
}

impl<'a> Writer<'a> {
    fn op(&mut self, b: u8) {
        self.out.push(b);
    }
    fn global(&mut self, module: &str, name: &str) {
        self.op(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.op(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.op(b'\n');
    }
    fn int(&mut self, v: i64) {
        if (0..=0xFF).contains(&v) {
            self.op(b'K');
            self.op(v as u8);
        } else if (0..=0xFFFF).contains(&v) {
            self.op(b'M');
            self.out.extend_from_slice(&(v as u16).to_le_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            self.op(b'J');
            self.out.extend_from_slice(&v.to_le_bytes());
        } else {
            // LONG1: minimal two's complement, little-endian.
            let bytes = v.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let (last, prev) = (bytes[n - 1], bytes[n - 2]);
                if (last == 0 && prev & 0x80 == 0) || (last == 0xFF && prev & 0x80 != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.op(0x8a);
            self.op(n as u8);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }
    fn uint(&mut self, v: u64) -> Result<(), CodecError> {
        let v = i64::try_from(v).map_err(|_| CodecError::TooLarge(format!("integer {v}")))?;
        self.int(v);
        Ok(())
    }
    fn string(&mut self, s: &str) {
        self.op(b'X');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }
    fn int_tuple(&mut self, v: &[u64]) -> Result<(), CodecError> {
        if v.is_empty() {
            self.op(b')');
            return Ok(());
        }
        self.op(b'(');
        for &x in v {
            self.uint(x)?;
        }
        self.op(b't');
        Ok(())
    }
    fn memo_put(&mut self, n: u32) {
        if n < 256 {
            self.op(b'q');
            self.op(n as u8);
        } else {
            self.op(b'r');
            self.out.extend_from_slice(&n.to_le_bytes());
        }
    }
    fn memo_get(&mut self, n: u32) {
        if n < 256 {
            self.op(b'h');
            self.op(n as u8);
        } else {
            self.op(b'j');
            self.out.extend_from_slice(&n.to_le_bytes());
        }
    }

    fn tensor(&mut self, name: &'a str) -> Result<(), CodecError> {
        if let Some(&n) = self.memo.get(name) {
            self.memo_get(n);
            return Ok(());
        }
        let slot = self.tensors.get(name).ok_or_else(|| {
            CodecError::Malformed(format!("metadata refers to a missing tensor `{name}`"))
        })?;
        let t = slot.tensor;
        let torch = dtypes::torch_name(t.dtype).ok_or_else(|| {
            CodecError::Malformed(format!(
                "tensor `{name}`: torch has no dtype for {}",
                t.dtype
            ))
        })?;
        let legacy = dtypes::storage_name(t.dtype);
        self.global(
            "torch._utils",
            if legacy.is_some() {
                "_rebuild_tensor_v2"
            } else {
                "_rebuild_tensor_v3"
            },
        );
        self.op(b'(');
        // The persistent id of the storage.
        self.op(b'(');
        self.string("storage");
        match legacy {
            Some(storage) => self.global("torch", storage),
            None => self.global("torch.storage", "UntypedStorage"),
        }
        self.string(&slot.key);
        self.string("cpu");
        let numel = t
            .numel()
            .map_err(|e| CodecError::Malformed(e.to_string()))?;
        self.uint(if legacy.is_some() {
            numel
        } else {
            t.data.len() as u64
        })?;
        self.op(b't');
        self.op(b'Q');
        self.int(0);
        self.int_tuple(&t.shape)?;
        self.int_tuple(&contiguous_strides(&t.shape))?;
        self.op(0x89); // requires_grad = False
        self.global("collections", "OrderedDict");
        self.op(b')');
        self.op(b'R');
        if legacy.is_none() {
            self.global("torch", torch);
        }
        self.op(b't');
        self.op(b'R');
        let n = self.memo.len() as u32;
        self.memo_put(n);
        self.memo.insert(name, n);
        Ok(())
    }

    fn value(&mut self, v: &'a Value, depth: usize) -> Result<(), CodecError> {
        if depth > MAX_DEPTH {
            return Err(CodecError::TooLarge("metadata nests too deeply".into()));
        }
        match v {
            Value::Null => self.op(b'N'),
            Value::Bool(b) => self.op(if *b { 0x88 } else { 0x89 }),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.op(b'G');
                self.out.extend_from_slice(&f.to_bits().to_be_bytes());
            }
            Value::Str(s) => self.string(s),
            Value::Bytes(b) => {
                // Protocol 2 has no bytes opcode: `_codecs.encode(<latin1 text>, 'latin1')`.
                self.global("_codecs", "encode");
                let text: String = b.iter().map(|&c| c as char).collect();
                self.string(&text);
                self.string("latin1");
                self.op(0x86);
                self.op(b'R');
            }
            Value::List(items) => {
                self.op(b']');
                for chunk in items.chunks(1000) {
                    self.op(b'(');
                    for it in chunk {
                        self.value(it, depth + 1)?;
                    }
                    self.op(b'e');
                }
            }
            Value::Tuple(items) => {
                self.op(b'(');
                for it in items {
                    self.value(it, depth + 1)?;
                }
                self.op(b't');
            }
            Value::Map(entries) => {
                self.op(b'}');
                for chunk in entries.chunks(1000) {
                    self.op(b'(');
                    for (k, v) in chunk {
                        match k {
                            Key::Int(i) => self.int(*i),
                            Key::Str(s) => self.string(s),
                        }
                        self.value(v, depth + 1)?;
                    }
                    self.op(b'u');
                }
            }
            Value::Tensor(name) => self.tensor(name)?,
        }
        Ok(())
    }
}

/// Pickle `root`; its [`Value::Tensor`] leaves name entries of `tensors`.
pub fn pickle<'a>(
    root: &'a Value,
    tensors: &'a HashMap<&'a str, Slot<'a>>,
) -> Result<Vec<u8>, CodecError> {
    let mut w = Writer {
        out: vec![0x80, 2],
        tensors,
        memo: HashMap::new(),
    };
    w.value(root, 0)?;
    w.op(b'.');
    Ok(w.out)
}
