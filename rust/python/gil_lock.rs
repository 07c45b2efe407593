//! [`GilLock`]: a lock whose takers are ordered by the interpreter lock instead of atomics.
//!
//! Every thread that takes it is attached to the interpreter (each method wants a [`Python`]
//! token), so the GIL already serializes the takers: the lock's state is plain cells that only
//! attached threads read and write. (A free-threaded interpreter builds the extension
//! version-specific and turns the GIL on when it imports it, which the module declares it needs;
//! the import fails where the GIL was forced off: see `native_module`.) Taking and dropping it
//! costs no atomic instruction, where a `Mutex` costs two, a sizeable part of a cached
//! alloc+free made from Python.
//!
//! A holder may let go of the interpreter while it keeps the lock ([`GilGuard::detach`], for
//! device calls). It holds `parked` meanwhile, so that a thread that wants the lock blocks on
//! that, detached, instead of spinning. A holder that lets go of the interpreter some other way
//! (a Python callback) holds no `parked`: a waiter then yields until the lock is free.
//!
//! A forked child inherits the lock as it was, with only the forking thread: a holder or waiter
//! that was detached at the fork does not exist there, and may have left `held` set or `parked`
//! locked. So a lock counts the forks it has seen, and the first taker in a child checks it
//! ([`GilLock::forked`], [`GilLock::adopt_after_fork`]).

use pyo3::Python;
use std::cell::{Cell, UnsafeCell};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, Once, PoisonError};

/// Forks this process descends from since the extension loaded: a child counts one more.
static FORKS: AtomicU32 = AtomicU32::new(0);

extern "C" fn count_fork() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

pub struct GilLock<T> {
    value: UnsafeCell<T>,
    /// Whether a guard exists (read and written only by attached threads).
    held: Cell<bool>,
    /// Whether a holder panicked (read and written only by attached threads).
    poisoned: Cell<bool>,
    /// Held by a guard while its thread is detached.
    parked: UnsafeCell<Mutex<()>>,
    /// `FORKS` when the lock was made or adopted by a child (read and written only by attached
    /// threads): the process it belongs to.
    forks: Cell<u32>,
}

// SAFETY: `held`, `poisoned` and `forks` are only touched by threads attached to the interpreter,
// whose GIL orders those accesses. `parked` is replaced only by `adopt_after_fork`, before any
// thread of the child used it (see there). `value` is only reached through a `GilGuard`, at most
// one of which exists at a time (`held`), and which never leaves its thread (it holds a `Python`
// token); while its thread is detached, only the closure it runs then reaches `value`. So `value`
// is used by one thread at a time, as `Mutex<T>` requires of `T: Send`.
unsafe impl<T: Send> Sync for GilLock<T> {}

impl<T> GilLock<T> {
    pub fn new(value: T) -> Self {
        static COUNTING: Once = Once::new();
        // SAFETY: the handler runs in the child right after fork, where only async-signal-safe
        // code may run: an atomic increment is.
        COUNTING.call_once(|| unsafe {
            libc::pthread_atfork(None, None, Some(count_fork as unsafe extern "C" fn()));
        });
        GilLock {
            value: UnsafeCell::new(value),
            held: Cell::new(false),
            poisoned: Cell::new(false),
            parked: UnsafeCell::new(Mutex::new(())),
            forks: Cell::new(FORKS.load(Ordering::Relaxed)),
        }
    }

    /// Whether the process forked since this lock was made or adopted: its state is the
    /// parent's, as the fork copied it.
    #[inline]
    pub fn forked(&self, _py: Python<'_>) -> bool {
        self.forks.get() != FORKS.load(Ordering::Relaxed)
    }

    /// Makes a lock of the parent's usable in this forked child, unless a thread held it at the
    /// fork: that thread does not exist here and left the value midway. Returns whether it did.
    #[cold]
    pub fn adopt_after_fork(&self, _py: Python<'_>) -> bool {
        if self.held.get() {
            return false;
        }
        // SAFETY: a waiter of the parent may have held `parked` at the fork; no thread here uses
        // it, since each takes the lock first, and this is the first take since the fork (taking
        // it checks `forked`, under the GIL this thread holds).
        unsafe { *self.parked.get() = Mutex::new(()) };
        self.forks.set(FORKS.load(Ordering::Relaxed));
        true
    }

    fn parked(&self) -> &Mutex<()> {
        // SAFETY: only `adopt_after_fork` writes it, while no thread uses it.
        unsafe { &*self.parked.get() }
    }

    /// Takes the lock, waiting detached while another thread holds it. Like `Mutex::lock`, `Err`
    /// means an earlier holder panicked; it still carries the guard (see
    /// [`GilGuard::clear_poison`]). In a forked child, adopt the lock first.
    #[inline]
    pub fn lock<'a, 'py>(&'a self, py: Python<'py>) -> Result<GilGuard<'a, 'py, T>, GilGuard<'a, 'py, T>> {
        debug_assert!(!self.forked(py), "a forked child's lock was taken before it was adopted");
        let parked = self.parked();
        while self.held.get() {
            py.detach(|| {
                drop(parked.lock());
                std::thread::yield_now();
            });
        }
        self.held.set(true);
        let guard = GilGuard { lock: self, py, panicking: std::thread::panicking() };
        if self.poisoned.get() {
            Err(guard)
        } else {
            Ok(guard)
        }
    }
}

/// Exclusive access to a [`GilLock`]'s value; it stays on the thread that took it.
pub struct GilGuard<'a, 'py, T> {
    lock: &'a GilLock<T>,
    py: Python<'py>,
    /// Whether the thread was unwinding already when it took the lock (as `MutexGuard` records).
    panicking: bool,
}

impl<T: Send> GilGuard<'_, '_, T> {
    /// Runs `op` on the value with the interpreter detached (other Python threads run; those
    /// that want this lock wait for `op`). The lock stays held while PyO3 attaches again, which
    /// first drops the `Py` references this extension let go of while detached: were one the last
    /// reference to an object whose destructor takes this lock, it would wait for itself. The
    /// extension lets go of none while detached (DLPack's deleter attaches first), so no Python
    /// code runs there.
    pub fn detach<R: Send>(&mut self, op: impl FnOnce(&mut T) -> R + Send) -> R {
        let _parked = self.lock.parked().lock().unwrap_or_else(PoisonError::into_inner);
        let py = self.py;
        let value = &mut **self;
        py.detach(move || op(value))
    }
}

impl<T> GilGuard<'_, '_, T> {
    /// Trusts the value again after a holder panicked.
    pub fn clear_poison(&self) {
        self.lock.poisoned.set(false);
    }
}

impl<T> Deref for GilGuard<'_, '_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `GilLock`'s `Sync`).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for GilGuard<'_, '_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the only one, and `&mut self` makes the borrow unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for GilGuard<'_, '_, T> {
    #[inline]
    fn drop(&mut self) {
        if !self.panicking && std::thread::panicking() {
            self.lock.poisoned.set(true);
        }
        self.lock.held.set(false);
    }
}
