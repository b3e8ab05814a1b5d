//! A restricted unpickler: it builds plain data and tensor references, and refuses
//! anything else. No code runs: the only callables it knows are a fixed list of
//! tensor rebuild functions, `OrderedDict` and `_codecs.encode` (bytes), all
//! implemented here as data constructors. Any other global (say `posix.system`)
//! is an error before anything is called.
//!
//! Objects live in an arena and are referred to by index, so the memo and in-place
//! mutation (`SETITEMS` after `BINPUT`) behave as in Python; cycles are caught by
//! the depth cap when the tree is converted. Every length is checked against the
//! input and against caps.

use ckpt_core::DType;

use crate::error::CodecError;
use crate::torch::dtypes;

/// Largest pickle accepted.
pub const MAX_PICKLE_BYTES: usize = 1 << 30;
/// Most objects one pickle may create.
pub const MAX_OBJECTS: usize = 1 << 24;

/// Index of an object in the arena.
pub type Id = usize;

/// A storage reference made by `BINPERSID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageRef {
    /// Record key under `data/`.
    pub key: String,
    /// Element type of a legacy typed storage; `None` for `UntypedStorage` (bytes).
    pub dtype: Option<DType>,
    /// Number of elements (bytes for untyped storages).
    pub numel: u64,
}

/// A tensor made by a rebuild function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    /// Its storage.
    pub storage: StorageRef,
    /// Element type.
    pub dtype: DType,
    /// Offset into the storage, in elements.
    pub offset: u64,
    /// Shape.
    pub size: Vec<u64>,
    /// Strides, in elements.
    pub stride: Vec<u64>,
}

/// The callables the unpickler knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    /// `torch._utils._rebuild_tensor_v2`.
    RebuildV2,
    /// `torch._utils._rebuild_tensor_v3` (takes a dtype).
    RebuildV3,
    /// `torch._utils._rebuild_parameter` (returns its data).
    RebuildParameter,
    /// `collections.OrderedDict`.
    OrderedDict,
    /// `_codecs.encode`, how protocol 2 pickles bytes.
    Encode,
    /// A legacy storage type such as `torch.FloatStorage`.
    StorageType(DType),
    /// `torch.storage.UntypedStorage`.
    Untyped,
    /// A dtype object such as `torch.float8_e4m3fn`.
    Dtype(DType),
}

/// An unpickled object.
#[derive(Debug, Clone, PartialEq)]
pub enum Obj {
    /// `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An int that fits in i64.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// Bytes.
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<Id>),
    /// A tuple.
    Tuple(Vec<Id>),
    /// A dict (or `OrderedDict`), in insertion order.
    Dict(Vec<(Id, Id)>),
    /// A known callable.
    Global(Global),
    /// A storage.
    Storage(StorageRef),
    /// A tensor.
    Tensor(TensorRef),
}

/// The result: every object, and the root.
#[derive(Debug, Clone)]
pub struct Pickle {
    /// The arena.
    pub objs: Vec<Obj>,
    /// The unpickled object.
    pub root: Id,
}

fn bad(s: impl Into<String>) -> CodecError {
    CodecError::Malformed(format!("pickle: {}", s.into()))
}

/// Resolve a `module.name` global, refusing everything that is not plain data.
pub fn resolve_global(module: &str, name: &str) -> Result<Global, CodecError> {
    let g = match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildV2,
        ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildV3,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("_codecs", "encode") => Global::Encode,
        ("torch.storage" | "torch", "UntypedStorage") => Global::Untyped,
        ("torch", n) if dtypes::from_storage_name(n).is_some() => {
            Global::StorageType(dtypes::from_storage_name(n).expect("checked"))
        }
        ("torch", n) if dtypes::from_torch_name(n).is_some() => Global::Dtype(dtypes::from_torch_name(n).expect("checked")),
        _ => {
            return Err(CodecError::Malformed(format!(
                "refused: the pickle calls `{module}.{name}`, which is not a tensor or plain container; \
                 ckpt never runs code from a checkpoint"
            )))
        }
    };
    Ok(g)
}

struct Machine<'a> {
    b: &'a [u8],
    at: usize,
    objs: Vec<Obj>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: std::collections::HashMap<u64, Id>,
}

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| CodecError::Truncated("pickle ends early".into()))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    fn le(&mut self, n: usize) -> Result<u64, CodecError> {
        let s = self.take(n)?;
        Ok(s.iter().rev().fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }
    fn line(&mut self) -> Result<&'a str, CodecError> {
        let rest = &self.b[self.at..];
        let n = rest
            .iter()
            .take(256)
            .position(|&c| c == b'\n')
            .ok_or_else(|| bad("GLOBAL line too long"))?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| bad("GLOBAL is not UTF-8"))?;
        self.at += n + 1;
        Ok(s)
    }
    fn alloc(&mut self, o: Obj) -> Result<Id, CodecError> {
        if self.objs.len() >= MAX_OBJECTS {
            return Err(CodecError::TooLarge("too many pickle objects".into()));
        }
        self.objs.push(o);
        Ok(self.objs.len() - 1)
    }
    fn push(&mut self, o: Obj) -> Result<(), CodecError> {
        let id = self.alloc(o)?;
        self.stack.push(id);
        Ok(())
    }
    fn pop(&mut self) -> Result<Id, CodecError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(bad("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked"))
    }
    fn pop_mark(&mut self) -> Result<Vec<Id>, CodecError> {
        let m = self.marks.pop().ok_or_else(|| bad("no MARK"))?;
        Ok(self.stack.split_off(m))
    }
    fn top(&self) -> Result<Id, CodecError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        self.stack
            .last()
            .copied()
            .filter(|_| self.stack.len() > floor)
            .ok_or_else(|| bad("stack underflow"))
    }
    fn str_of(&mut self, n: u64) -> Result<(), CodecError> {
        let n = usize::try_from(n).map_err(|_| CodecError::TooLarge("string".into()))?;
        let s = std::str::from_utf8(self.take(n)?).map_err(|_| bad("string is not UTF-8"))?;
        self.push(Obj::Str(s.to_owned()))
    }
    fn bytes_of(&mut self, n: u64) -> Result<(), CodecError> {
        let n = usize::try_from(n).map_err(|_| CodecError::TooLarge("bytes".into()))?;
        let s = self.take(n)?.to_vec();
        self.push(Obj::Bytes(s))
    }
    fn set_items(&mut self, target: Id, items: Vec<Id>) -> Result<(), CodecError> {
        if items.len() % 2 != 0 {
            return Err(bad("odd SETITEMS"));
        }
        let Obj::Dict(d) = &mut self.objs[target] else {
            return Err(bad("SETITEMS on a non-dict"));
        };
        for kv in items.chunks(2) {
            d.push((kv[0], kv[1]));
        }
        Ok(())
    }
    fn append(&mut self, target: Id, items: Vec<Id>) -> Result<(), CodecError> {
        let Obj::List(l) = &mut self.objs[target] else {
            return Err(bad("APPEND on a non-list"));
        };
        l.extend(items);
        Ok(())
    }
}

/// Unpickle `bytes` under the restrictions above.
pub fn unpickle(bytes: &[u8]) -> Result<Pickle, CodecError> {
    if bytes.len() > MAX_PICKLE_BYTES {
        return Err(CodecError::TooLarge(format!(
            "pickle of {} bytes",
            bytes.len()
        )));
    }
    let mut m = Machine {
        b: bytes,
        at: 0,
        objs: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Default::default(),
    };
    loop {
        let op = m.u8()?;
        match op {
            0x80 => {
                let p = m.u8()?; // PROTO
                if p > 5 {
                    return Err(bad(format!("protocol {p}")));
                }
            }
            0x95 => {
                m.take(8)?; // FRAME
            }
            b'.' => break, // STOP
            b'(' => m.marks.push(m.stack.len()),
            b'0' => {
                m.pop()?;
            }
            b'1' => {
                m.pop_mark()?;
            }
            b'2' => {
                let t = m.top()?;
                m.stack.push(t);
            }
            b'N' => m.push(Obj::None)?,
            0x88 => m.push(Obj::Bool(true))?,
            0x89 => m.push(Obj::Bool(false))?,
            b'J' => {
                let v = m.le(4)? as u32 as i32 as i64;
                m.push(Obj::Int(v))?
            }
            b'K' => {
                let v = m.le(1)? as i64;
                m.push(Obj::Int(v))?
            }
            b'M' => {
                let v = m.le(2)? as i64;
                m.push(Obj::Int(v))?
            }
            0x8a => {
                let n = m.u8()? as usize; // LONG1
                if n > 8 {
                    return Err(bad("integer wider than 64 bits"));
                }
                let s = m.take(n)?;
                let mut v: i64 = 0;
                for (i, &b) in s.iter().enumerate() {
                    v |= (b as i64) << (8 * i);
                }
                if n > 0 && n < 8 && s[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n); // sign-extend
                }
                m.push(Obj::Int(v))?
            }
            b'G' => {
                let s = m.take(8)?;
                let v = f64::from_bits(u64::from_be_bytes(s.try_into().expect("8 bytes")));
                m.push(Obj::Float(v))?
            }
            b'X' => {
                let n = m.le(4)?;
                m.str_of(n)?
            }
            0x8c => {
                let n = m.le(1)?;
                m.str_of(n)?
            }
            0x8d => {
                let n = m.le(8)?;
                m.str_of(n)?
            }
            b'U' => {
                let n = m.le(1)?; // SHORT_BINSTRING: a Python 2 str, read as text
                m.str_of(n)?
            }
            b'B' => {
                let n = m.le(4)?;
                m.bytes_of(n)?
            }
            b'C' => {
                let n = m.le(1)?;
                m.bytes_of(n)?
            }
            0x8e => {
                let n = m.le(8)?;
                m.bytes_of(n)?
            }
            b']' => m.push(Obj::List(Vec::new()))?,
            b'}' => m.push(Obj::Dict(Vec::new()))?,
            b')' => m.push(Obj::Tuple(Vec::new()))?,
            b't' => {
                let items = m.pop_mark()?;
                m.push(Obj::Tuple(items))?
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(m.pop()?);
                }
                items.reverse();
                m.push(Obj::Tuple(items))?
            }
            b'a' => {
                let v = m.pop()?;
                let l = m.top()?;
                m.append(l, vec![v])?
            }
            b'e' => {
                let items = m.pop_mark()?;
                let l = m.top()?;
                m.append(l, items)?
            }
            b's' => {
                let v = m.pop()?;
                let k = m.pop()?;
                let d = m.top()?;
                m.set_items(d, vec![k, v])?
            }
            b'u' => {
                let items = m.pop_mark()?;
                let d = m.top()?;
                m.set_items(d, items)?
            }
            b'c' => {
                let module = m.line()?;
                let name = m.line()?;
                let g = resolve_global(module, name)?;
                m.push(Obj::Global(g))?
            }
            0x93 => {
                let name = m.pop()?;
                let module = m.pop()?;
                let (Obj::Str(module), Obj::Str(name)) = (&m.objs[module], &m.objs[name]) else {
                    return Err(bad("STACK_GLOBAL needs two strings"));
                };
                let g = resolve_global(module, name)?;
                m.push(Obj::Global(g))?
            }
            b'R' => {
                let args = m.pop()?;
                let f = m.pop()?;
                let o = reduce(&m.objs, f, args)?;
                m.push(o)?
            }
            b'b' => {
                // BUILD: instance attributes (such as a state dict's `_metadata`) are dropped.
                m.pop()?;
                let target = m.top()?;
                if !matches!(m.objs[target], Obj::Dict(_) | Obj::Tensor(_)) {
                    return Err(bad("BUILD is only allowed on dicts and tensors"));
                }
            }
            b'Q' => {
                let pid = m.pop()?;
                let o = persistent_load(&m.objs, pid)?;
                m.push(o)?
            }
            b'q' | b'r' | 0x94 => {
                let key = match op {
                    b'q' => m.le(1)?,
                    b'r' => m.le(4)?,
                    _ => m.memo.len() as u64,
                };
                let t = m.top()?;
                m.memo.insert(key, t);
            }
            b'h' | b'j' => {
                let key = if op == b'h' { m.le(1)? } else { m.le(4)? };
                let id = *m
                    .memo
                    .get(&key)
                    .ok_or_else(|| bad(format!("memo key {key} missing")))?;
                m.stack.push(id);
            }
            other => return Err(bad(format!("opcode 0x{other:02x} is not allowed"))),
        }
    }
    let root = m.pop()?;
    Ok(Pickle { objs: m.objs, root })
}

fn ints(objs: &[Obj], id: Id, what: &str) -> Result<Vec<u64>, CodecError> {
    let Obj::Tuple(items) = &objs[id] else {
        return Err(bad(format!("{what} is not a tuple")));
    };
    items
        .iter()
        .map(|&i| match objs[i] {
            Obj::Int(v) if v >= 0 => Ok(v as u64),
            _ => Err(bad(format!("{what} holds a non-integer"))),
        })
        .collect()
}

fn reduce(objs: &[Obj], f: Id, args: Id) -> Result<Obj, CodecError> {
    let Obj::Global(g) = objs[f] else {
        return Err(bad("REDUCE of something that is not an allowed global"));
    };
    let Obj::Tuple(a) = &objs[args] else {
        return Err(bad("REDUCE arguments are not a tuple"));
    };
    match g {
        Global::RebuildV2 | Global::RebuildV3 => {
            if a.len() < 4 {
                return Err(bad("rebuild_tensor needs 4 arguments"));
            }
            let Obj::Storage(storage) = &objs[a[0]] else {
                return Err(bad("tensor without storage"));
            };
            let Obj::Int(offset) = objs[a[1]] else {
                return Err(bad("bad storage offset"));
            };
            let offset = u64::try_from(offset).map_err(|_| bad("negative storage offset"))?;
            let size = ints(objs, a[2], "size")?;
            let stride = ints(objs, a[3], "stride")?;
            if size.len() != stride.len() {
                return Err(bad("size and stride differ in length"));
            }
            let dtype = match (g, storage.dtype) {
                (Global::RebuildV3, _) => match a.get(6).map(|&i| &objs[i]) {
                    Some(Obj::Global(Global::Dtype(d))) => *d,
                    _ => return Err(bad("rebuild_tensor_v3 without a dtype")),
                },
                (_, Some(d)) => d,
                (_, None) => return Err(bad("untyped storage without a dtype")),
            };
            Ok(Obj::Tensor(TensorRef {
                storage: storage.clone(),
                dtype,
                offset,
                size,
                stride,
            }))
        }
        Global::RebuildParameter => match a.first().map(|&i| &objs[i]) {
            Some(t @ Obj::Tensor(_)) => Ok(t.clone()),
            _ => Err(bad("rebuild_parameter without a tensor")),
        },
        Global::OrderedDict => match a.as_slice() {
            [] => Ok(Obj::Dict(Vec::new())),
            [items] => {
                let (Obj::List(pairs) | Obj::Tuple(pairs)) = &objs[*items] else {
                    return Err(bad("OrderedDict of a non-list"));
                };
                let mut d = Vec::with_capacity(pairs.len());
                for &p in pairs {
                    match &objs[p] {
                        Obj::Tuple(kv) if kv.len() == 2 => d.push((kv[0], kv[1])),
                        _ => return Err(bad("OrderedDict item is not a pair")),
                    }
                }
                Ok(Obj::Dict(d))
            }
            _ => Err(bad("OrderedDict takes one argument")),
        },
        Global::Encode => match a.as_slice() {
            [s, enc] => match (&objs[*s], &objs[*enc]) {
                (Obj::Str(s), Obj::Str(e)) if e == "latin1" || e == "latin-1" => s
                    .chars()
                    .map(|c| u8::try_from(c as u32).map_err(|_| bad("latin1 string out of range")))
                    .collect::<Result<Vec<u8>, _>>()
                    .map(Obj::Bytes),
                _ => Err(bad("_codecs.encode is allowed only for latin1 strings")),
            },
            _ => Err(bad("_codecs.encode takes two arguments")),
        },
        Global::StorageType(_) | Global::Untyped | Global::Dtype(_) => {
            Err(bad("storage types and dtypes cannot be called"))
        }
    }
}

fn persistent_load(objs: &[Obj], pid: Id) -> Result<Obj, CodecError> {
    let Obj::Tuple(a) = &objs[pid] else {
        return Err(bad("persistent id is not a tuple"));
    };
    let [tag, ty, key, _location, numel] = a.as_slice() else {
        return Err(bad("persistent id has the wrong length"));
    };
    if objs[*tag] != Obj::Str("storage".into()) {
        return Err(bad("persistent id is not a storage"));
    }
    let dtype = match objs[*ty] {
        Obj::Global(Global::StorageType(d)) => Some(d),
        Obj::Global(Global::Untyped) => None,
        _ => return Err(bad("unknown storage type")),
    };
    let Obj::Str(key) = &objs[*key] else {
        return Err(bad("storage key is not a string"));
    };
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(bad("storage key is not a plain name"));
    }
    let Obj::Int(numel) = objs[*numel] else {
        return Err(bad("storage size is not an integer"));
    };
    let numel = u64::try_from(numel).map_err(|_| bad("negative storage size"))?;
    Ok(Obj::Storage(StorageRef {
        key: key.clone(),
        dtype,
        numel,
    }))
}
