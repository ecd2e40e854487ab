//! GGUF reader: the header, every metadata value, the tensor infos and the tensors' bytes
//! of a GGUF file (v2 or v3, little-endian) or of a split set
//! `name-00001-of-0000N.gguf` … `name-0000N-of-0000N.gguf`, memory-mapped.
//!
//! Layout (ggml's `gguf.cpp`, gguf-py's `GGUFWriter`): magic `GGUF`, `u32` version,
//! `u64` tensor count, `u64` metadata count; the key/value pairs (`u64`-length UTF-8 key,
//! `u32` value type, value; arrays are `u32` element type, `u64` count, elements, and may
//! nest); the tensor infos (name, `u32` dimension count, `u64` dims with `ne0` — the
//! number of columns, the fastest-varying axis — first, `u32` ggml type, `u64` offset
//! into the data section); padding to `general.alignment` (default 32); the data section.
//!
//! Hand-parsed: of the crates.io GGUF parsers seen (`gguf` 0.1.2, `gguf-rs` 0.1.8,
//! `gguf-rs-lib`), none documents split-file support or errors that name the tensor and
//! offset, and each would still need our own checks of tensor extents against ggml block
//! sizes; the header is small enough to read exactly here.
//!
//! Nothing here panics on a malformed file: every count is checked against the bytes
//! that remain before anything is allocated, sizes use checked arithmetic, and each
//! error names the file, the offset and what was being read.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use smoe_proto::GgmlType;

/// The four bytes every GGUF file starts with.
const MAGIC: &[u8; 4] = b"GGUF";
/// Data-section alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
const MAX_DIMS: u64 = 4;
/// Deepest nesting of metadata arrays accepted (real files use 1; this bounds recursion).
const MAX_ARRAY_DEPTH: usize = 8;

/// A GGUF file could not be read, or does not say what a GGUF file must.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Opening or mapping a file failed.
    #[error("cannot read {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The file does not start with `GGUF`.
    #[error("{} is not a GGUF file: it starts with {found:02x?}, a GGUF file with \"GGUF\"", path.display())]
    Magic {
        /// The file.
        path: PathBuf,
        /// Its first bytes.
        found: Vec<u8>,
    },
    /// A GGUF version this reader does not read.
    #[error("{}: GGUF version {version} is not supported (supported: 2 and 3){hint}", path.display())]
    Version {
        /// The file.
        path: PathBuf,
        /// The version field.
        version: u32,
        /// Extra advice (big-endian files).
        hint: &'static str,
    },
    /// The file ends before something it declares.
    #[error("{} is truncated: {what} at offset {offset} needs {need} bytes but the file has {len}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// Bytes it needs.
        need: u64,
        /// Length of the file.
        len: u64,
    },
    /// A value that no valid GGUF file holds (bad type code, count, UTF-8, dims, ...).
    #[error("{}: invalid {what} at offset {offset}: {detail}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// A tensor whose type id ggml does not define.
    #[error("{}: tensor {tensor} has unknown ggml type id {id}", path.display())]
    UnknownType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Its type id.
        id: u32,
    },
    /// A tensor's data lies (partly) outside the file.
    #[error(
        "{}: tensor {tensor} ({size} bytes at file offset {start}) runs past the end of the file \
         ({len} bytes); the file is truncated",
        path.display()
    )]
    TensorOutOfBounds {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Absolute offset of its data.
        start: u64,
        /// Bytes of its data.
        size: u64,
        /// Length of the file.
        len: u64,
    },
    /// A tensor of a type smoe-pipeline has no kernel for.
    #[error(
        "tensor {tensor} is {ty}, which smoe-pipeline cannot compute with (supported: {}); \
         requantise the model to one of those (e.g. Q4_K_M, Q8_0)",
        GgmlType::supported_names()
    )]
    UnsupportedType {
        /// The tensor.
        tensor: String,
        /// Its type.
        ty: GgmlType,
    },
    /// The parts of a split file do not fit together.
    #[error("{}: {detail}", path.display())]
    Split {
        /// The part concerned.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A metadata key that must be present is not.
    #[error("GGUF metadata key {key} is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value of another type than asked for.
    #[error("GGUF metadata key {key} holds {found}, expected {expected}")]
    KeyType {
        /// The key.
        key: String,
        /// What the caller wanted.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },
    /// No tensor of that name in any part.
    #[error("the GGUF file has no tensor {0}")]
    NoTensor(String),
}

type Result<T> = std::result::Result<T, GgufError>;

/// Metadata keys and values in file order.
type Metadata = Vec<(String, Value)>;

/// Type code of a metadata value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    /// `u8` (code 0).
    U8,
    /// `i8` (1).
    I8,
    /// `u16` (2).
    U16,
    /// `i16` (3).
    I16,
    /// `u32` (4).
    U32,
    /// `i32` (5).
    I32,
    /// `f32` (6).
    F32,
    /// `bool`, one byte 0 or 1 (7).
    Bool,
    /// UTF-8 string with a `u64` length (8).
    String,
    /// Array: element type, `u64` count, elements (9).
    Array,
    /// `u64` (10).
    U64,
    /// `i64` (11).
    I64,
    /// `f64` (12).
    F64,
}

impl ValueType {
    fn from_code(code: u32) -> Option<ValueType> {
        use ValueType::*;
        [U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64].get(code as usize).copied()
    }

    /// Lower-case name of the type.
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Smallest encoding of one value of this type (a string is at least its length,
    /// an array at least its element type and count).
    fn min_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f32`.
    F32(f32),
    /// `f64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// A string.
    String(String),
    /// An array of values of one element type (possibly arrays themselves).
    Array(ValueType, Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width
    /// (writers differ on the width of counts such as `block_count`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as an f64, if it is a float (or an integer, converted).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// Type name for messages (`u32`, `string`, `array of string`, ...).
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(t, _) => format!("array of {}", ValueType::name(*t)),
            v => ValueType::name(v.value_type()).to_string(),
        }
    }

    fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
        }
    }
}

impl fmt::Display for Value {
    /// Scalars as themselves, strings quoted, arrays abbreviated past 8 elements.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(_, items) => {
                write!(f, "[")?;
                for (i, v) in items.iter().take(8).enumerate() {
                    write!(f, "{}{v}", if i > 0 { ", " } else { "" })?;
                }
                if items.len() > 8 {
                    write!(f, ", … ({} items)", items.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

/// One tensor of a GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name (llama.cpp's, e.g. `blk.0.ffn_gate_exps.weight`).
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` (`ne0`) is the number of columns, the
    /// contiguous axis; the reverse of the row-major shape.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data from the start of its part's data section.
    pub offset: u64,
    /// Bytes of the data.
    pub size: u64,
    /// Index of the part (file) holding the data.
    pub part: usize,
}

impl TensorInfo {
    /// The row-major shape, outermost first (`dims` reversed), as HuggingFace writes it.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Elements per row (`ne0`).
    pub fn cols(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of every dimension but the first.
    pub fn rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// One file of a (possibly split) GGUF model.
#[derive(Debug)]
pub struct Part {
    /// The file.
    pub path: PathBuf,
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Alignment of the data section and of every tensor's offset.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    map: Mmap,
}

/// A GGUF model: the metadata of its first part and the tensors of all parts.
#[derive(Debug)]
pub struct GgufFile {
    parts: Vec<Part>,
    metadata: Metadata,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl GgufFile {
    /// Opens `path`; when its name is `*-00001-of-0000N.gguf`, opens the other parts of
    /// the split set next to it as well.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let split = split_names(path);
        let paths = match &split {
            Some((1, names)) => names.clone(),
            Some((k, names)) => {
                return Err(GgufError::Split {
                    path: path.to_path_buf(),
                    detail: format!(
                        "this is part {k} of a {}-part split model; open the first part, {}",
                        names.len(),
                        names[0].display()
                    ),
                })
            }
            None => vec![path.to_path_buf()],
        };
        let parts = paths.iter().enumerate().map(|(i, p)| read_part(p, i)).collect::<Result<Vec<_>>>()?;
        GgufFile::assemble(parts)
    }

    /// Reads a single-file GGUF model from `bytes` (copied into memory); `name` stands
    /// for the file in errors. For parsing untrusted bytes without a file.
    pub fn from_bytes(name: &Path, bytes: &[u8]) -> Result<GgufFile> {
        let (header, metadata, tensors) = parse_part(name, 0, bytes)?;
        let io = |source| GgufError::Io { path: name.to_path_buf(), source };
        // Not empty: the header was read from it.
        let mut map = memmap2::MmapMut::map_anon(bytes.len()).map_err(io)?;
        map.copy_from_slice(bytes);
        let part = header.with_map(name, map.make_read_only().map_err(io)?);
        GgufFile::assemble(vec![(part, metadata, tensors)])
    }

    /// The model of the parts read (first part first): the first part's metadata, every
    /// part's tensors, checked for split keys, duplicate names and the total count.
    fn assemble(read: Vec<(Part, Metadata, Vec<TensorInfo>)>) -> Result<GgufFile> {
        let paths: Vec<PathBuf> = read.iter().map(|(p, _, _)| p.path.clone()).collect();
        let mut file = GgufFile {
            parts: Vec::new(),
            metadata: Vec::new(),
            keys: HashMap::new(),
            tensors: Vec::new(),
            by_name: HashMap::new(),
        };
        // Each part's split.tensors.count, checked once every part is read.
        let mut totals = Vec::new();
        for (i, (part, metadata, tensors)) in read.into_iter().enumerate() {
            let p = &paths[i];
            check_split_keys(p, &metadata, i, paths.len())?;
            let total =
                metadata.iter().find(|(k, _)| k == "split.tensors.count").and_then(|(_, v)| v.as_u64());
            totals.push((p.clone(), total));
            if i == 0 {
                file.keys = metadata.iter().enumerate().map(|(j, (k, _))| (k.clone(), j)).collect();
                file.metadata = metadata;
            }
            for t in tensors {
                if let Some(&j) = file.by_name.get(&t.name) {
                    let first = file.tensors[j].part;
                    let detail = if first == i {
                        format!("tensor {} appears twice in this file", t.name)
                    } else {
                        format!("tensor {} is also in {}", t.name, paths[first].display())
                    };
                    return Err(GgufError::Split { path: p.clone(), detail });
                }
                file.by_name.insert(t.name.clone(), file.tensors.len());
                file.tensors.push(t);
            }
            file.parts.push(part);
        }
        for (p, total) in totals {
            if let Some(n) = total.filter(|&n| n != file.tensors.len() as u64) {
                return Err(GgufError::Split {
                    path: p,
                    detail: format!(
                        "split.tensors.count says {n} tensors, the {} part(s) hold {}",
                        paths.len(),
                        file.tensors.len()
                    ),
                });
            }
        }
        Ok(file)
    }

    /// The files, first part first.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Every metadata key and value of the first part, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::KeyType { key: key.to_string(), expected, found: v.type_name() }
    }

    /// The string value of `key`.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(Self::wrong(key, "a string", v)),
        }
    }

    /// The value of `key` as an unsigned integer (any non-negative integer type).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
    }

    /// The value of `key` as an f64 (any float or integer type).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "a number", v))
    }

    /// The elements of the array `key`, as strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        match self.require(key)? {
            Value::Array(ValueType::String, items) => Ok(items
                .iter()
                .filter_map(|v| match v {
                    Value::String(s) => Some(s.as_str()),
                    _ => None,
                })
                .collect()),
            v => Err(Self::wrong(key, "an array of string", v)),
        }
    }

    /// `general.architecture` (e.g. `qwen3moe`), the prefix of the model's keys.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// Every tensor, in file order (part by part).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i]).ok_or_else(|| GgufError::NoTensor(name.to_string()))
    }

    /// The bytes of tensor `name`, straight from the memory map (extents were checked
    /// when the file was opened).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        let part = &self.parts[t.part];
        // In range: read_part checked data_start + offset + size <= file length.
        let start = (part.data_start + t.offset) as usize;
        Ok(&part.map[start..start + t.size as usize])
    }

    /// Fails on the first tensor whose type has no kernel, naming it, its type and the
    /// supported types.
    pub fn check_supported(&self) -> Result<()> {
        match self.tensors.iter().find(|t| !t.ty.is_supported()) {
            Some(t) => Err(GgufError::UnsupportedType { tensor: t.name.clone(), ty: t.ty }),
            None => Ok(()),
        }
    }
}

/// For `prefix-0000K-of-0000N.gguf`: `K` and the paths of all `N` parts.
fn split_names(path: &Path) -> Option<(usize, Vec<PathBuf>)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, n) = stem.rsplit_once("-of-")?;
    let (prefix, k) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(k) || !digits(n) {
        return None;
    }
    let (k, n): (usize, usize) = (k.parse().ok()?, n.parse().ok()?);
    if k == 0 || k > n {
        return None;
    }
    let names = (1..=n).map(|i| path.with_file_name(format!("{prefix}-{i:05}-of-{n:05}.gguf"))).collect();
    Some((k, names))
}

/// Checks `split.no` / `split.count` of part `index` of a set of `count` files.
fn check_split_keys(path: &Path, metadata: &[(String, Value)], index: usize, count: usize) -> Result<()> {
    let get = |key: &str| metadata.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.as_u64());
    let err = |detail: String| GgufError::Split { path: path.to_path_buf(), detail };
    match get("split.count") {
        Some(n) if n != count as u64 => {
            return Err(err(format!("split.count says {n} parts, the file names say {count}")))
        }
        None if count > 1 => return Err(err("a part of a split model has no split.count".to_string())),
        _ => {}
    }
    match get("split.no") {
        // split.no counts from 0.
        Some(no) if no != index as u64 => {
            Err(err(format!("split.no is {no}, expected {index} for this file")))
        }
        _ => Ok(()),
    }
}

/// Reads the file of part `index`: [`parse_part`] on its memory map.
fn read_part(path: &Path, index: usize) -> Result<(Part, Metadata, Vec<TensorInfo>)> {
    let io = |source| GgufError::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io)?;
    // SAFETY: GGUF input is read-only; it must not change while it is converted.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    let (header, metadata, tensors) = parse_part(path, index, &map)?;
    Ok((header.with_map(path, map), metadata, tensors))
}

/// What a part's header says, before it is paired with its bytes.
struct PartHeader {
    version: u32,
    alignment: u64,
    data_start: u64,
}

impl PartHeader {
    fn with_map(self, path: &Path, map: Mmap) -> Part {
        let PartHeader { version, alignment, data_start } = self;
        Part { path: path.to_path_buf(), version, alignment, data_start, map }
    }
}

/// Parses the header, metadata and tensor infos of part `index` (the bytes of `path`);
/// checks every tensor's extent against the bytes.
fn parse_part(path: &Path, index: usize, map: &[u8]) -> Result<(PartHeader, Metadata, Vec<TensorInfo>)> {
    let mut r = Reader { path, buf: map, pos: 0 };
    let magic = r.bytes(4, "magic")?;
    if magic != MAGIC {
        return Err(GgufError::Magic { path: path.to_path_buf(), found: magic.to_vec() });
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        let hint = if (2..=3).contains(&version.swap_bytes()) {
            " — this is a big-endian GGUF; use a little-endian file"
        } else {
            ""
        };
        return Err(GgufError::Version { path: path.to_path_buf(), version, hint });
    }
    let n_tensors = r.u64("tensor count")?;
    let n_kv = r.u64("metadata count")?;
    // Each pair is at least a key length, a type code and a 1-byte value.
    let n_kv = r.count(n_kv, 8 + 4 + 1, "metadata count")?;
    let mut metadata = Vec::with_capacity(n_kv);
    let mut seen = HashSet::new();
    for _ in 0..n_kv {
        let at = r.pos as u64;
        let key = r.string("metadata key")?;
        let code = r.u32(&format!("type of metadata value {key}"))?;
        let value = r.value(code, &key, 0)?;
        if !seen.insert(key.clone()) {
            return Err(r.invalid("metadata key", at, format!("duplicate key {key}")));
        }
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => {
            return Err(r.invalid(
                "general.alignment",
                0,
                format!("must be a u32 power of two, found {} {v}", v.type_name()),
            ))
        }
    };
    // Each tensor info is at least a name length, a dim count, a type and an offset.
    let n_tensors = r.count(n_tensors, 8 + 4 + 4 + 8, "tensor count")?;
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        tensors.push(r.tensor_info(index, alignment)?);
    }
    let len = map.len() as u64;
    let data_start = (r.pos as u64).next_multiple_of(alignment);
    for t in &tensors {
        let start = data_start.checked_add(t.offset);
        if start.and_then(|s| s.checked_add(t.size)).is_none_or(|end| end > len) {
            return Err(GgufError::TensorOutOfBounds {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                start: start.unwrap_or(u64::MAX),
                size: t.size,
                len,
            });
        }
    }
    Ok((PartHeader { version, alignment, data_start }, metadata, tensors))
}

/// A bounds-checked little-endian cursor over a mapped file.
struct Reader<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn invalid(&self, what: &str, offset: u64, detail: String) -> GgufError {
        GgufError::Invalid { path: self.path.to_path_buf(), what: what.to_string(), offset, detail }
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N as u64, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items of at least `min_bytes` each, checked against the bytes left so
    /// that nothing is allocated for a count the file cannot hold.
    fn count(&self, n: u64, min_bytes: u64, what: &str) -> Result<usize> {
        match n.checked_mul(min_bytes) {
            Some(need) if need <= self.remaining() => Ok(n as usize),
            Some(need) => Err(self.invalid(
                what,
                self.pos as u64,
                format!(
                    "{n} items need at least {need} bytes but {} remain: the file is truncated or corrupt",
                    self.remaining()
                ),
            )),
            None => Err(self.invalid(what, self.pos as u64, format!("{n} items cannot fit in a file"))),
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos as u64;
        let len = self.u64(what)?;
        let bytes = self.bytes(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| self.invalid(what, at, format!("not UTF-8: {e}")))
    }

    /// A value of type `code` of key `key`, arrays nested at most [`MAX_ARRAY_DEPTH`].
    fn value(&mut self, code: u32, key: &str, depth: usize) -> Result<Value> {
        let at = self.pos as u64;
        let what = format!("value of {key}");
        let ty = ValueType::from_code(code)
            .ok_or_else(|| self.invalid(&what, at, format!("unknown value type {code}")))?;
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.array(&what).map(i8::from_le_bytes)?),
            ValueType::U16 => Value::U16(self.array(&what).map(u16::from_le_bytes)?),
            ValueType::I16 => Value::I16(self.array(&what).map(i16::from_le_bytes)?),
            ValueType::U32 => Value::U32(self.u32(&what)?),
            ValueType::I32 => Value::I32(self.array(&what).map(i32::from_le_bytes)?),
            ValueType::U64 => Value::U64(self.u64(&what)?),
            ValueType::I64 => Value::I64(self.array(&what).map(i64::from_le_bytes)?),
            ValueType::F32 => Value::F32(self.array(&what).map(f32::from_le_bytes)?),
            ValueType::F64 => Value::F64(self.array(&what).map(f64::from_le_bytes)?),
            ValueType::Bool => match self.array::<1>(&what)?[0] {
                b @ (0 | 1) => Value::Bool(b == 1),
                b => return Err(self.invalid(&what, at, format!("bool byte {b}"))),
            },
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.invalid(
                        &what,
                        at,
                        format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    ));
                }
                let code = self.u32(&what)?;
                let elem = ValueType::from_code(code)
                    .ok_or_else(|| self.invalid(&what, at, format!("unknown array element type {code}")))?;
                let n = self.u64(&what)?;
                let n = self.count(n, elem.min_bytes(), &what)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(code, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }

    /// One tensor info of part `part`; its dims, type, offset and size are checked.
    fn tensor_info(&mut self, part: usize, alignment: u64) -> Result<TensorInfo> {
        let at = self.pos as u64;
        let name = self.string("tensor name")?;
        let what = format!("tensor info of {name}");
        let n_dims = self.u32(&what)?;
        if u64::from(n_dims) > MAX_DIMS {
            return Err(self.invalid(
                &what,
                at,
                format!("{n_dims} dimensions (ggml has at most {MAX_DIMS})"),
            ));
        }
        let dims = (0..n_dims).map(|_| self.u64(&what)).collect::<Result<Vec<u64>>>()?;
        let id = self.u32(&what)?;
        let offset = self.u64(&what)?;
        let ty = GgmlType::from_id(id).ok_or_else(|| GgufError::UnknownType {
            path: self.path.to_path_buf(),
            tensor: name.clone(),
            id,
        })?;
        if !offset.is_multiple_of(alignment) {
            return Err(self.invalid(
                &what,
                at,
                format!("data offset {offset} is not a multiple of {alignment}"),
            ));
        }
        let cols = dims.first().copied().unwrap_or(1);
        let rows = dims.iter().skip(1).try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let row_bytes = usize::try_from(cols).ok().and_then(|c| ty.row_bytes(c));
        let size = match (rows, row_bytes) {
            (Some(rows), Some(rb)) => rows.checked_mul(rb as u64),
            _ => None,
        };
        let size = size.ok_or_else(|| {
            self.invalid(
                &what,
                at,
                format!(
                    "dims {dims:?} of {ty} overflow or do not split into whole blocks of {} elements",
                    ty.block_elems()
                ),
            )
        })?;
        Ok(TensorInfo { name, dims, ty, offset, size, part })
    }
}

#[cfg(test)]
#[path = "gguf_tests.rs"]
pub(crate) mod tests;
