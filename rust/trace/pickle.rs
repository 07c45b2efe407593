//! The opcodes of a Python pickle (protocols 0 to 5), read without running any of them.
//!
//! A pickle is a program for a stack machine. [`Opcodes`] splits it into [`Op`]s and checks what
//! needs no stack: every argument's bytes are there before anything is sized from a length; text
//! arguments parse; a memo index is below the number of opcodes read so far. Picklers number
//! their memo entries from 0 as they write them, so a larger index only comes from damage, and
//! honouring it is what makes CPython's unpickler allocate (and zero) gigabytes. Opcodes that
//! look up a global or call code are refused. The machine that builds the objects needs Python
//! and lives in the bindings (`python/pickle.rs`).

use std::fmt;

/// The highest protocol Python writes (3.8 and later).
const HIGHEST_PROTOCOL: u8 = 5;
/// Longest module or class name an error message quotes.
const NAME_IN_MESSAGE: usize = 80;

/// One decoded opcode with its argument; slices borrow from the pickle.
#[derive(Clone, Debug, PartialEq)]
pub enum Op<'a> {
    Mark,
    Stop,
    Pop,
    PopMark,
    Dup,
    None,
    Bool(bool),
    Int(i64),
    /// A decimal integer too large for `i64` (INT, LONG): an optional sign, then digits.
    IntText(&'a str),
    /// A two's complement little-endian integer too large for `i64` (LONG1, LONG4).
    IntBytes(&'a [u8]),
    Float(f64),
    /// UTF-8 in which lone surrogates may be encoded, as `surrogatepass` writes them (BINUNICODE*).
    Utf8(&'a [u8]),
    /// Protocol 0's `raw-unicode-escape` text (UNICODE).
    RawUnicodeEscape(&'a [u8]),
    /// A Python 2 `str` literal between its quotes, backslash escapes undone by the reader (STRING).
    EscapedAscii(&'a [u8]),
    /// A Python 2 `str`, which `pickle.loads` decodes as ASCII by default (BINSTRING, SHORT_BINSTRING).
    Ascii(&'a [u8]),
    Bytes(&'a [u8]),
    ByteArray(&'a [u8]),
    EmptyList,
    Append,
    Appends,
    List,
    EmptyTuple,
    /// TUPLE1, TUPLE2, TUPLE3: a tuple of the top `n` items.
    TupleOf(usize),
    Tuple,
    EmptyDict,
    SetItem,
    SetItems,
    Dict,
    EmptySet,
    AddItems,
    FrozenSet,
    Put(usize),
    Memoize,
    Get(usize),
    /// Refused by the machine, which can name the global from the two strings below it.
    StackGlobal,
}

/// An opcode with where it starts and what `pickletools` calls it, for error messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Step<'a> {
    pub at: usize,
    pub opcode: &'static str,
    pub op: Op<'a>,
}

/// Why a pickle is not read. Every variant names the byte offset of the opcode at fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PickleError {
    /// The data ends inside an opcode's fixed-size or line argument.
    Truncated {
        at: usize,
        opcode: &'static str,
    },
    /// A length prefix larger than the bytes that follow it.
    Oversized {
        at: usize,
        opcode: &'static str,
        length: u64,
        left: usize,
    },
    /// The data ends without a STOP opcode.
    NoStop {
        at: usize,
    },
    Unknown {
        at: usize,
        byte: u8,
    },
    /// An opcode that looks up a global or calls code; `what` says what the pickle would make.
    Refused {
        at: usize,
        opcode: &'static str,
        what: String,
    },
    /// Anything else wrong at an opcode: its text, a memo index, the stack, the marks.
    Malformed {
        at: usize,
        opcode: &'static str,
        why: String,
    },
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated { at, opcode } => write!(f, "the data is cut short inside {opcode} at byte {at}"),
            Self::Oversized { at, opcode, length, left } => {
                write!(f, "{opcode} at byte {at} claims {length} bytes, but only {left} follow")
            }
            Self::NoStop { at } => write!(f, "the data ends at byte {at} without a STOP opcode"),
            Self::Unknown { at, byte } => write!(f, "unknown opcode 0x{byte:02x} at byte {at}"),
            Self::Refused { at, opcode, what } => write!(
                f,
                "it holds {what} ({opcode} at byte {at}); only plain dicts, lists, strings and numbers are read"
            ),
            Self::Malformed { at, opcode, why } => write!(f, "{opcode} at byte {at}: {why}"),
        }
    }
}

impl std::error::Error for PickleError {}

impl PickleError {
    /// GLOBAL, INST or STACK_GLOBAL's refusal, naming the global `(module, name)` when known.
    pub fn global(at: usize, opcode: &'static str, global: Option<(&[u8], &[u8])>) -> Self {
        let what = match global {
            Some((module, name)) => format!("a {}.{} object", quote(module), quote(name)),
            None => "a reference to a global".into(),
        };
        Self::Refused { at, opcode, what }
    }
}

/// The pickle's opcodes in order; PROTO and FRAME are checked and skipped.
pub struct Opcodes<'a> {
    data: &'a [u8],
    pos: usize,
    /// Opcodes read so far, the current one included: the bound on memo indices.
    count: usize,
}

impl<'a> Opcodes<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0, count: 0 }
    }

    /// The next opcode; running out of data before STOP is an error.
    #[inline]
    pub fn next_step(&mut self) -> Result<Step<'a>, PickleError> {
        loop {
            let at = self.pos;
            let &byte = self.data.get(at).ok_or(PickleError::NoStop { at })?;
            let opcode = opcode_name(byte).ok_or(PickleError::Unknown { at, byte })?;
            self.pos += 1;
            self.count += 1;
            let mut args = Args { opcodes: self, at, opcode };
            if let Some(op) = args.decode(byte)? {
                return Ok(Step { at, opcode, op });
            }
        }
    }
}

/// Reads one opcode's arguments, failing with that opcode's name and offset.
struct Args<'o, 'a> {
    opcodes: &'o mut Opcodes<'a>,
    at: usize,
    opcode: &'static str,
}

impl<'a> Args<'_, 'a> {
    /// The opcode's [`Op`], or `None` for PROTO and FRAME, which only check their argument.
    #[inline]
    fn decode(&mut self, byte: u8) -> Result<Option<Op<'a>>, PickleError> {
        let op = match byte {
            b'(' => Op::Mark,
            b'.' => Op::Stop,
            b'0' => Op::Pop,
            b'1' => Op::PopMark,
            b'2' => Op::Dup,
            b'N' => Op::None,
            0x88 => Op::Bool(true),
            0x89 => Op::Bool(false),
            // Protocol 0 writes booleans as INT 00 and 01.
            b'I' => match self.line_text()? {
                "00" => Op::Bool(false),
                "01" => Op::Bool(true),
                text => self.int_text(text)?,
            },
            b'L' => {
                let text = self.line_text()?;
                self.int_text(text.strip_suffix('L').unwrap_or(text))?
            }
            b'J' => Op::Int(i32::from_le_bytes(self.array()?).into()),
            b'K' => Op::Int(self.uint(1)? as i64),
            b'M' => Op::Int(self.uint(2)? as i64),
            0x8a => int_bytes(self.sized(1)?),
            0x8b => int_bytes(self.signed_sized()?),
            b'F' => self.float_text()?,
            b'G' => Op::Float(f64::from_be_bytes(self.array()?)),
            b'X' => Op::Utf8(self.sized(4)?),
            0x8c => Op::Utf8(self.sized(1)?),
            0x8d => Op::Utf8(self.sized(8)?),
            b'V' => Op::RawUnicodeEscape(self.line()?),
            b'S' => self.quoted()?,
            b'T' => Op::Ascii(self.signed_sized()?),
            b'U' => Op::Ascii(self.sized(1)?),
            b'B' => Op::Bytes(self.sized(4)?),
            b'C' => Op::Bytes(self.sized(1)?),
            0x8e => Op::Bytes(self.sized(8)?),
            0x96 => Op::ByteArray(self.sized(8)?),
            b']' => Op::EmptyList,
            b'a' => Op::Append,
            b'e' => Op::Appends,
            b'l' => Op::List,
            b')' => Op::EmptyTuple,
            0x85 => Op::TupleOf(1),
            0x86 => Op::TupleOf(2),
            0x87 => Op::TupleOf(3),
            b't' => Op::Tuple,
            b'}' => Op::EmptyDict,
            b's' => Op::SetItem,
            b'u' => Op::SetItems,
            b'd' => Op::Dict,
            0x8f => Op::EmptySet,
            0x90 => Op::AddItems,
            0x91 => Op::FrozenSet,
            b'p' => {
                let index = self.index_text()?;
                self.put(index)?
            }
            b'q' => {
                let index = self.uint(1)?;
                self.put(index as usize)?
            }
            b'r' => {
                let index = self.uint(4)?;
                self.put(index as usize)?
            }
            0x94 => Op::Memoize,
            b'g' => Op::Get(self.index_text()?),
            b'h' => Op::Get(self.uint(1)? as usize),
            b'j' => Op::Get(self.uint(4)? as usize),
            0x93 => Op::StackGlobal,
            0x80 => {
                let protocol = self.uint(1)?;
                if protocol > HIGHEST_PROTOCOL.into() {
                    return Err(self.malformed(format!("unsupported protocol {protocol}")));
                }
                return Ok(None);
            }
            0x95 => {
                // Frames only group opcodes for buffered readers; their contents are read as usual.
                let length = self.uint(8)?;
                self.check_length(length)?;
                return Ok(None);
            }
            _ => return Err(self.refused(byte)),
        };
        Ok(Some(op))
    }

    fn refused(&mut self, byte: u8) -> PickleError {
        let what = match byte {
            b'c' | b'i' => {
                let global = self.line().and_then(|module| Ok((module, self.line()?)));
                return PickleError::global(self.at, self.opcode, global.ok());
            }
            b'R' => "a function call".into(),
            b'b' => "an object's state".into(),
            b'o' | 0x81 | 0x92 => "a class instance".into(),
            b'P' | b'Q' => "a persistent reference".into(),
            0x82..=0x84 => "a registered extension".into(),
            0x97 | 0x98 => "an out-of-band buffer".into(),
            _ => unreachable!("opcode 0x{byte:02x} has a name but no decoding"),
        };
        PickleError::Refused { at: self.at, opcode: self.opcode, what }
    }

    fn malformed(&self, why: String) -> PickleError {
        PickleError::Malformed { at: self.at, opcode: self.opcode, why }
    }

    fn put(&self, index: usize) -> Result<Op<'a>, PickleError> {
        let read = self.opcodes.count;
        if index >= read {
            return Err(self.malformed(format!("memo index {index} is beyond the {read} opcodes read so far")));
        }
        Ok(Op::Put(index))
    }

    fn check_length(&self, length: u64) -> Result<usize, PickleError> {
        let left = self.opcodes.data.len() - self.opcodes.pos;
        match usize::try_from(length) {
            Ok(n) if n <= left => Ok(n),
            _ => Err(PickleError::Oversized { at: self.at, opcode: self.opcode, length, left }),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let Opcodes { data, pos, .. } = *self.opcodes;
        let bytes = data.get(pos..pos + n).ok_or(PickleError::Truncated { at: self.at, opcode: self.opcode })?;
        self.opcodes.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    /// A little-endian unsigned integer of `width` bytes (at most 8).
    fn uint(&mut self, width: usize) -> Result<u64, PickleError> {
        let mut le = [0; 8];
        le[..width].copy_from_slice(self.take(width)?);
        Ok(u64::from_le_bytes(le))
    }

    /// Bytes after an unsigned little-endian length of `width` bytes.
    fn sized(&mut self, width: usize) -> Result<&'a [u8], PickleError> {
        let length = self.uint(width)?;
        let n = self.check_length(length)?;
        self.take(n)
    }

    /// Bytes after a signed 4-byte length (LONG4, BINSTRING), which must not be negative.
    fn signed_sized(&mut self) -> Result<&'a [u8], PickleError> {
        let length = i32::from_le_bytes(self.array()?);
        let length = u64::try_from(length).map_err(|_| self.malformed(format!("negative byte count {length}")))?;
        let n = self.check_length(length)?;
        self.take(n)
    }

    /// The argument up to the next newline, which is consumed but not returned.
    fn line(&mut self) -> Result<&'a [u8], PickleError> {
        let rest = &self.opcodes.data[self.opcodes.pos..];
        let end = rest.iter().position(|&b| b == b'\n');
        let end = end.ok_or(PickleError::Truncated { at: self.at, opcode: self.opcode })?;
        self.opcodes.pos += end + 1;
        Ok(&rest[..end])
    }

    /// A line holding a number, without the whitespace around it.
    fn line_text(&mut self) -> Result<&'a str, PickleError> {
        let line = self.line()?;
        let text = std::str::from_utf8(line).map_err(|_| self.malformed(format!("{} is not a number", quote(line))))?;
        Ok(text.trim())
    }

    /// INT and LONG's text: decimal, the only form picklers write (CPython also reads `0x10`).
    fn int_text(&self, text: &'a str) -> Result<Op<'a>, PickleError> {
        let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.malformed(format!("{} is not an integer", quote(text.as_bytes()))));
        }
        Ok(text.parse().map_or(Op::IntText(text), Op::Int))
    }

    fn float_text(&mut self) -> Result<Op<'a>, PickleError> {
        let text = self.line_text()?;
        let value = text.parse().map_err(|_| self.malformed(format!("{} is not a float", quote(text.as_bytes()))))?;
        Ok(Op::Float(value))
    }

    /// PUT and GET's decimal memo index.
    fn index_text(&mut self) -> Result<usize, PickleError> {
        let text = self.line_text()?;
        match text.parse() {
            Ok(index) if text.bytes().all(|b| b.is_ascii_digit()) => Ok(index),
            _ => Err(self.malformed(format!("{} is not a memo index", quote(text.as_bytes())))),
        }
    }

    /// STRING's argument: a Python 2 `repr` of a `str`, quoted with `'` or `"`.
    fn quoted(&mut self) -> Result<Op<'a>, PickleError> {
        match self.line()? {
            [quote, inner @ .., end] if quote == end && matches!(quote, b'\'' | b'"') => Ok(Op::EscapedAscii(inner)),
            _ => Err(self.malformed("the argument must be quoted".into())),
        }
    }
}

/// LONG1 and LONG4's two's complement little-endian bytes; `i64` when they fit.
fn int_bytes(bytes: &[u8]) -> Op<'_> {
    if bytes.len() > 8 {
        return Op::IntBytes(bytes);
    }
    let negative = bytes.last().is_some_and(|&b| b & 0x80 != 0);
    let mut le = [if negative { 0xff } else { 0 }; 8];
    le[..bytes.len()].copy_from_slice(bytes);
    Op::Int(i64::from_le_bytes(le))
}

/// A name from the pickle for an error message: lossy UTF-8, shortened.
fn quote(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    match text.char_indices().nth(NAME_IN_MESSAGE) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.into_owned(),
    }
}

/// Every opcode of protocols 0 to 5, named as `pickletools` names it.
#[inline]
fn opcode_name(byte: u8) -> Option<&'static str> {
    Some(match byte {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ops up to STOP, or the first error.
    fn ops(data: &[u8]) -> Result<Vec<Op<'_>>, PickleError> {
        let mut opcodes = Opcodes::new(data);
        let mut ops = Vec::new();
        loop {
            match opcodes.next_step()?.op {
                Op::Stop => return Ok(ops),
                op => ops.push(op),
            }
        }
    }

    fn error(data: &[u8]) -> String {
        ops(data).expect_err("the pickle should be refused").to_string()
    }

    #[test]
    fn every_byte_decodes_or_fails_without_panicking() {
        let mut named = 0;
        for byte in 0..=255u8 {
            named += usize::from(opcode_name(byte).is_some());
            for tail in [&b""[..], b"\x00", b"1\n.", &[0xff; 9]] {
                let _ = ops(&[&[byte][..], tail].concat());
            }
        }
        assert_eq!(named, 68, "pickletools knows 68 opcodes in protocols 0 to 5");
    }

    #[test]
    fn lengths_are_checked_before_anything_is_sized_from_them() {
        let huge = (1u64 << 62).to_le_bytes();
        for opcode in [0x8d, 0x8e, 0x96, 0x95] {
            let data = [&[opcode][..], &huge, b"."].concat();
            assert!(matches!(ops(&data), Err(PickleError::Oversized { length, left: 1, .. }) if length == 1 << 62));
        }
        let too_long = [&[0x8b][..], &i32::MAX.to_le_bytes(), b"."].concat();
        assert_eq!(error(&too_long), "LONG4 at byte 0 claims 2147483647 bytes, but only 1 follow");
        let negative = [&[0x8b][..], &i32::MIN.to_le_bytes(), b"."].concat();
        assert_eq!(error(&negative), "LONG4 at byte 0: negative byte count -2147483648");
        assert_eq!(error(b"X\xff\xff\xff\xff."), "BINUNICODE at byte 0 claims 4294967295 bytes, but only 1 follow");
    }

    #[test]
    fn a_memo_index_beyond_the_opcodes_read_is_refused() {
        assert_eq!(ops(b"Nq\x00."), Ok(vec![Op::None, Op::Put(0)]));
        assert_eq!(ops(b"Nq\x01."), Ok(vec![Op::None, Op::Put(1)]));
        assert!(error(b"Nq\x02.").contains("memo index 2 is beyond the 2 opcodes read so far"));
        assert!(error(b"Nr\xf0\xff\xff\xff.").starts_with("LONG_BINPUT at byte 1: memo index 4294967280 is beyond"));
        assert!(error(b"Np99999999999999999999999\n.").contains("is not a memo index"));
        assert_eq!(ops(b"Nj\xf0\xff\xff\xff."), Ok(vec![Op::None, Op::Get(0xffff_fff0)]));
    }

    #[test]
    fn integers_decode_in_every_form() {
        let ints = |data| ops(data).unwrap();
        assert_eq!(
            ints(b"\x8a\x00\x8a\x01\xff\x8a\x02\x80\x00K\xffM\xff\xffJ\xff\xff\xff\xff."),
            [Op::Int(0), Op::Int(-1), Op::Int(128), Op::Int(255), Op::Int(65535), Op::Int(-1)]
        );
        assert_eq!(
            ints(b"\x8a\x09\x01\x02\x03\x04\x05\x06\x07\x08\x09."),
            [Op::IntBytes(b"\x01\x02\x03\x04\x05\x06\x07\x08\x09")]
        );
        assert_eq!(
            ints(b"I00\nI01\nI-5\nL12L\nL123456789012345678901\n."),
            [Op::Bool(false), Op::Bool(true), Op::Int(-5), Op::Int(12), Op::IntText("123456789012345678901")]
        );
        assert_eq!(error(b"I0x10\n."), "INT at byte 0: 0x10 is not an integer");
    }

    #[test]
    fn code_and_globals_are_refused_naming_them() {
        assert_eq!(
            error(b"cos\nsystem\n(S'true'\ntR."),
            "it holds a os.system object (GLOBAL at byte 0); only plain dicts, lists, strings and numbers are read"
        );
        assert!(error(b"cos\nsys").starts_with("it holds a reference to a global (GLOBAL at byte 0)"));
        assert!(error(b"N)R.").starts_with("it holds a function call (REDUCE at byte 2)"));
        assert_eq!(ops(b"\x93."), Ok(vec![Op::StackGlobal]));
    }

    #[test]
    fn damage_names_the_opcode_and_offset() {
        assert_eq!(error(b"N"), "the data ends at byte 1 without a STOP opcode");
        assert_eq!(error(b"NJ\x01\x02"), "the data is cut short inside BININT at byte 1");
        assert_eq!(error(b"N\xff."), "unknown opcode 0xff at byte 1");
        assert_eq!(error(b"\x80\x06N."), "PROTO at byte 0: unsupported protocol 6");
        assert_eq!(error(b"Sabc\n."), "STRING at byte 0: the argument must be quoted");
        assert_eq!(ops(b"S'a\\n'\n."), Ok(vec![Op::EscapedAscii(b"a\\n")]));
    }
}
