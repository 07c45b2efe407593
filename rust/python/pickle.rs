//! `gpupool._native.load_pickle`: the plain data in a pickle, built without running any code.
//!
//! A stack machine over [`Opcodes`]: no recursion, so nesting depth costs heap, not the C stack.
//! The memo holds the very objects it was given, so shared references (and cycles) come out
//! shared, as `pickle.loads` makes them. Stack discipline follows CPython's `_pickle.c`: items
//! below the newest MARK are out of reach until a MARK-consuming opcode removes it.

use super::error::value_error;
use crate::trace::pickle::{Op, Opcodes, PickleError, Step};
use pyo3::exceptions::PyMemoryError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{
    IntoPyDict, PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyFrozenSet, PyInt, PyList, PySet, PyString, PyTuple,
};

/// The object a pickle holds, if it is made of None, bools, ints, floats, str, bytes, bytearray,
/// tuples, lists, dicts, sets and frozensets, with only [flat keys](check_key) in the dicts and
/// sets; any other pickle is a ValueError saying why, with the opcode and byte offset at fault.
#[pyfunction]
pub fn load_pickle<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let mut machine = Machine { py, stack: Vec::new(), marks: Vec::new(), memo: Vec::new(), memo_len: 0 };
    let mut opcodes = Opcodes::new(data);
    loop {
        let step = opcodes.next_step().map_err(value_error)?;
        match step.op {
            Op::Stop => return machine.pop(&step),
            _ => machine.run(&step)?,
        }
    }
}

struct Machine<'py> {
    py: Python<'py>,
    stack: Vec<Bound<'py, PyAny>>,
    /// The stack's length at each MARK still open.
    marks: Vec<usize>,
    /// Indexed by memo key; the decoder bounds keys by the opcodes read, so by the input's length.
    memo: Vec<Option<Bound<'py, PyAny>>>,
    /// Entries stored: MEMOIZE's key, as CPython counts it.
    memo_len: usize,
}

impl<'py> Machine<'py> {
    fn run(&mut self, step: &Step<'_>) -> PyResult<()> {
        let py = self.py;
        let building = |e: PyErr| building_error(py, step, e);
        let made = match step.op {
            Op::Mark => {
                push(&mut self.marks, self.stack.len())?;
                return Ok(());
            }
            Op::Pop if self.marks.last() == Some(&self.stack.len()) => {
                // CPython lets POP drop a MARK with nothing above it.
                self.marks.pop();
                return Ok(());
            }
            Op::Pop => {
                self.pop(step)?;
                return Ok(());
            }
            Op::PopMark => {
                let mark = self.close_mark(step)?;
                self.stack.truncate(mark);
                return Ok(());
            }
            Op::Dup => self.top(step)?.clone(),
            Op::List => {
                let mark = self.close_mark(step)?;
                PyList::new(py, self.stack.drain(mark..))?.into_any()
            }
            Op::Tuple => {
                let mark = self.close_mark(step)?;
                PyTuple::new(py, self.stack.drain(mark..))?.into_any()
            }
            Op::TupleOf(n) => {
                if self.stack.len() - self.fence() < n {
                    return Err(underflow(step));
                }
                PyTuple::new(py, self.stack.drain(self.stack.len() - n..))?.into_any()
            }
            Op::Dict => {
                let mark = self.close_mark(step)?;
                let dict = PyDict::new(py);
                set_items(&dict, &self.stack[mark..], step)?;
                self.stack.truncate(mark);
                dict.into_any()
            }
            Op::FrozenSet => {
                let mark = self.close_mark(step)?;
                self.stack[mark..].iter().try_for_each(|member| check_key(member, "a set member", step))?;
                PyFrozenSet::new(py, self.stack.drain(mark..)).map_err(building)?.into_any()
            }
            Op::Append | Op::Appends | Op::SetItem | Op::SetItems | Op::AddItems => return self.add_items(step),
            Op::Put(key) => return self.memoize(key, step),
            Op::Memoize => return self.memoize(self.memo_len, step),
            Op::Get(key) => match self.memo.get(key) {
                Some(Some(value)) => value.clone(),
                _ => return Err(malformed(step, format!("memo key {key} was never stored"))),
            },
            Op::StackGlobal => return Err(self.stack_global(step)),
            ref op => scalar(py, op).map_err(building)?,
        };
        push(&mut self.stack, made)
    }

    /// APPEND(S), SETITEM(S) and ADDITEMS: the items on top go into the list, dict or set below.
    fn add_items(&mut self, step: &Step<'_>) -> PyResult<()> {
        let start = match step.op {
            Op::Append => self.stack.len().saturating_sub(1),
            Op::SetItem => self.stack.len().saturating_sub(2),
            _ => self.close_mark(step)?,
        };
        // The target sits just below the items, and must be above the newest MARK.
        if start <= self.fence() {
            return Err(underflow(step));
        }
        if start == self.stack.len() {
            return Ok(()); // nothing added: CPython never looks at the target
        }
        let (target, items) = (&self.stack[start - 1], &self.stack[start..]);
        let building = |e: PyErr| building_error(self.py, step, e);
        let wrong_kind = |_| {
            let kind = target.get_type().name().map_or_else(|_| "?".into(), |name| name.to_string());
            malformed(step, format!("cannot add items to a {kind}"))
        };
        match step.op {
            Op::Append | Op::Appends => {
                let list = target.cast_exact::<PyList>().map_err(wrong_kind)?;
                items.iter().try_for_each(|item| list.append(item)).map_err(building)?;
            }
            Op::SetItem | Op::SetItems => set_items(target.cast_exact::<PyDict>().map_err(wrong_kind)?, items, step)?,
            _ => {
                let set = target.cast_exact::<PySet>().map_err(wrong_kind)?;
                items.iter().try_for_each(|item| check_key(item, "a set member", step))?;
                items.iter().try_for_each(|item| set.add(item)).map_err(building)?;
            }
        }
        self.stack.truncate(start);
        Ok(())
    }

    /// Where the newest MARK cuts the stack (0 when none is open).
    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self, step: &Step<'_>) -> PyResult<Bound<'py, PyAny>> {
        if self.stack.len() <= self.fence() {
            return Err(underflow(step));
        }
        Ok(self.stack.pop().expect("the stack is longer than its fence"))
    }

    fn top(&self, step: &Step<'_>) -> PyResult<&Bound<'py, PyAny>> {
        match self.stack.len() > self.fence() {
            true => Ok(self.stack.last().expect("the stack is longer than its fence")),
            false => Err(underflow(step)),
        }
    }

    /// Closes the newest MARK and returns where it was: the items above it are the opcode's.
    fn close_mark(&mut self, step: &Step<'_>) -> PyResult<usize> {
        self.marks.pop().ok_or_else(|| malformed(step, "no MARK is open".into()))
    }

    fn memoize(&mut self, key: usize, step: &Step<'_>) -> PyResult<()> {
        let value = self.top(step)?.clone();
        if key >= self.memo.len() {
            self.memo.try_reserve(key + 1 - self.memo.len()).map_err(out_of_memory)?;
            self.memo.resize(key + 1, None);
        }
        if self.memo[key].replace(value).is_none() {
            self.memo_len += 1;
        }
        Ok(())
    }

    /// STACK_GLOBAL's refusal, naming the global when the pickle pushed it as two strings.
    fn stack_global(&self, step: &Step<'_>) -> PyErr {
        let n = self.stack.len();
        let (module, name) = (self.stack.get(n.wrapping_sub(2)), self.stack.get(n.wrapping_sub(1)));
        let global = utf8(module).zip(utf8(name));
        value_error(PickleError::global(step.at, step.opcode, global))
    }
}

/// The stack, marks and memo grow by a word for each byte of input, so a long enough pickle runs
/// out of memory in them: a MemoryError, where a plain `Vec::push` would abort the process.
fn push<T>(items: &mut Vec<T>, item: T) -> PyResult<()> {
    items.try_reserve(1).map_err(out_of_memory)?;
    items.push(item);
    Ok(())
}

fn out_of_memory(_: std::collections::TryReserveError) -> PyErr {
    PyMemoryError::new_err("out of memory for the pickle reader's stack and memo")
}

/// The object an opcode that takes nothing from the stack pushes.
fn scalar<'py>(py: Python<'py>, op: &Op<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match *op {
        Op::None => py.None().into_bound(py),
        Op::Bool(value) => PyBool::new(py, value).to_owned().into_any(),
        Op::Int(value) => value.into_pyobject(py)?.into_any(),
        Op::IntText(text) => py.get_type::<PyInt>().call1((text,))?,
        Op::IntBytes(bytes) => {
            let signed = [("signed", true)].into_py_dict(py)?;
            py.get_type::<PyInt>().call_method("from_bytes", (PyBytes::new(py, bytes), "little"), Some(&signed))?
        }
        Op::Float(value) => PyFloat::new(py, value).into_any(),
        Op::Utf8(bytes) => utf8_with_surrogates(py, bytes)?,
        Op::RawUnicodeEscape(bytes) => raw_unicode_escape(py, bytes)?,
        Op::EscapedAscii(bytes) => ascii(py, unescape(py, bytes)?.as_bytes())?,
        Op::Ascii(bytes) => ascii(py, bytes)?,
        // `new_with`: a fresh object even for one byte, as CPython's reader makes it, and a
        // MemoryError rather than a panic when memory runs out.
        Op::Bytes(bytes) => PyBytes::new_with(py, bytes.len(), copy(bytes))?.into_any(),
        Op::ByteArray(bytes) => PyByteArray::new_with(py, bytes.len(), copy(bytes))?.into_any(),
        Op::EmptyList => PyList::empty(py).into_any(),
        Op::EmptyTuple => PyTuple::empty(py).into_any(),
        Op::EmptyDict => PyDict::new(py).into_any(),
        Op::EmptySet => PySet::empty(py)?.into_any(),
        ref op => unreachable!("{op:?} uses the stack"),
    })
}

/// Fills a new bytes or bytearray with `bytes`.
fn copy(bytes: &[u8]) -> impl FnOnce(&mut [u8]) -> PyResult<()> + '_ {
    |buffer| {
        buffer.copy_from_slice(bytes);
        Ok(())
    }
}

/// A str's UTF-8, if `item` is one.
fn utf8<'a>(item: Option<&'a Bound<'_, PyAny>>) -> Option<&'a [u8]> {
    Some(item?.cast_exact::<PyString>().ok()?.to_str().ok()?.as_bytes())
}

/// DICT and SETITEMS: `items` alternate keys and values.
fn set_items(dict: &Bound<'_, PyDict>, items: &[Bound<'_, PyAny>], step: &Step<'_>) -> PyResult<()> {
    if !items.len().is_multiple_of(2) {
        return Err(malformed(step, format!("an odd number of items ({}) for keys and values", items.len())));
    }
    for pair in items.chunks_exact(2) {
        check_key(&pair[0], "a dict key", step)?;
        dict.set_item(&pair[0], &pair[1]).map_err(|e| building_error(dict.py(), step, e))?;
    }
    Ok(())
}

/// Dict keys and set members are refused unless flat: hashing a tuple (or frozenset) nested a
/// million deep recurses in C until the stack overflows, and ints beyond 64 bits can be chosen to
/// share one hash (`n % (2**61 - 1)`), which makes each insertion compare against all the
/// others. Floats collide a few dozen at most, str and bytes hashes are salted. Snapshots key
/// their dicts by str alone.
fn check_key(key: &Bound<'_, PyAny>, what: &str, step: &Step<'_>) -> PyResult<()> {
    let flat = key.is_none()
        || key.is_exact_instance_of::<PyString>()
        || key.is_exact_instance_of::<PyBytes>()
        || key.is_exact_instance_of::<PyBool>()
        || key.is_exact_instance_of::<PyFloat>();
    if flat {
        return Ok(());
    }
    if key.is_exact_instance_of::<PyInt>() {
        if key.extract::<i64>().is_ok() || key.extract::<u64>().is_ok() {
            return Ok(());
        }
        return Err(malformed(step, format!("{what} is an int beyond 64 bits")));
    }
    let kind = key.get_type().name().map_or_else(|_| "?".into(), |name| name.to_string());
    Err(malformed(step, format!("{what} is a {kind}: only str, bytes, int, float, bool and None are read")))
}

// The text decoders are CPython's own, called as `_pickle.c` calls them, so the str objects match.

/// BINUNICODE*: UTF-8 as the pickler writes it, lone surrogates encoded (`surrogatepass`).
fn utf8_with_surrogates<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: the pointer and length describe `bytes`, which outlives the call.
    owned(py, unsafe { ffi::PyUnicode_DecodeUTF8(bytes.as_ptr().cast(), len(bytes), c"surrogatepass".as_ptr()) })
}

/// UNICODE: protocol 0's `raw-unicode-escape` text.
fn raw_unicode_escape<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: as in `utf8_with_surrogates`; a null error handler means strict.
    owned(py, unsafe { ffi::PyUnicode_DecodeRawUnicodeEscape(bytes.as_ptr().cast(), len(bytes), std::ptr::null()) })
}

/// STRING: the bytes of a Python 2 `str` literal with its backslash escapes undone.
fn unescape<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    // SAFETY: as in `utf8_with_surrogates`; the null and 0 arguments are the unused encoding ones.
    let unescaped = owned(py, unsafe {
        ffi::PyBytes_DecodeEscape(bytes.as_ptr().cast(), len(bytes), std::ptr::null(), 0, std::ptr::null())
    })?;
    Ok(unescaped.cast_into::<PyBytes>()?)
}

/// A Python 2 `str`, decoded as `pickle.loads` does by default.
fn ascii<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: as in `utf8_with_surrogates`.
    owned(py, unsafe { ffi::PyUnicode_DecodeASCII(bytes.as_ptr().cast(), len(bytes), c"strict".as_ptr()) })
}

fn owned(py: Python<'_>, object: *mut ffi::PyObject) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: every caller passes a new reference (or null with an exception set) fresh from the C API.
    unsafe { Bound::from_owned_ptr_or_err(py, object) }
}

fn len(bytes: &[u8]) -> ffi::Py_ssize_t {
    // A slice never exceeds isize::MAX bytes.
    bytes.len() as ffi::Py_ssize_t
}

fn malformed(step: &Step<'_>, why: String) -> PyErr {
    value_error(PickleError::Malformed { at: step.at, opcode: step.opcode, why })
}

fn underflow(step: &Step<'_>) -> PyErr {
    malformed(step, "too few items on the stack (above the newest MARK)".into())
}

/// A Python error while building an object (an unhashable key, a bad escape) is the pickle's
/// fault; running out of memory is not, and stays a MemoryError.
fn building_error(py: Python<'_>, step: &Step<'_>, e: PyErr) -> PyErr {
    if e.is_instance_of::<PyMemoryError>(py) {
        return e;
    }
    malformed(step, e.to_string())
}
