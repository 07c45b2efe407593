//! `Faulty`: a device adaptor that injects faults (refusals, errors, panics) into chosen calls and
//! can make calls slow, to exercise out-of-memory paths, error recovery and lock handling.

use super::{Device, DeviceError, EventId, MemoryInfo, StreamId};
use std::time::Duration;

/// When a counted call fails.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultSchedule {
    /// Never: only the delay applies.
    Never,
    /// The n-th counted call (1-based) and only it.
    Nth(u64),
    /// Each counted call with this probability, from a seeded generator.
    Probability { p: f64, seed: u64 },
}

/// What a failing call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultEffect {
    /// Returns an error: `OutOfMemory` from `allocate` and `map`, a driver error otherwise.
    Error,
    /// Panics before reaching the device.
    Panic,
    /// Reaches the device, then panics: the device changed but its caller never hears of it.
    PanicAfter,
}

/// The device calls a plan can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultCall {
    Allocate,
    Release,
    Map,
    Unmap,
    RecordEvent,
    Synchronize,
    Copy,
}

impl FaultCall {
    pub const ALL: [FaultCall; 7] = [
        FaultCall::Allocate,
        FaultCall::Release,
        FaultCall::Map,
        FaultCall::Unmap,
        FaultCall::RecordEvent,
        FaultCall::Synchronize,
        FaultCall::Copy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultCall::Allocate => "allocate",
            FaultCall::Release => "release",
            FaultCall::Map => "map",
            FaultCall::Unmap => "unmap",
            FaultCall::RecordEvent => "record_event",
            FaultCall::Synchronize => "synchronize",
            FaultCall::Copy => "copy",
        }
    }
}

/// One value of a fault plan's settings, as the bindings pass them.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultSetting {
    Int(u64),
    Float(f64),
    Text(String),
    List(Vec<String>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct FaultPlan {
    pub schedule: FaultSchedule,
    pub effect: FaultEffect,
    /// The calls the schedule counts; by default those that obtain memory.
    pub calls: Vec<FaultCall>,
    /// Added to every call that would reach a real device (allocations, maps, copies, waits).
    pub delay: Duration,
}

impl FaultPlan {
    pub fn new(schedule: FaultSchedule) -> Self {
        FaultPlan {
            schedule,
            effect: FaultEffect::Error,
            calls: vec![FaultCall::Allocate, FaultCall::Map],
            delay: Duration::ZERO,
        }
    }

    /// A plan from `key: value` settings: `nth` or `probability` (with `seed`), `effect`
    /// (`error`, `panic`, `panic_after`), `calls` (names of [`FaultCall`]s), `delay` (seconds).
    /// Errors name the bad key.
    pub fn from_settings(settings: &[(String, FaultSetting)]) -> Result<Self, String> {
        let get = |key: &str| settings.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let known = ["nth", "probability", "seed", "effect", "calls", "delay"];
        if let Some((key, _)) = settings.iter().find(|(k, _)| !known.contains(&k.as_str())) {
            return Err(format!("unknown key '{key}' (known: {})", known.join(", ")));
        }
        let schedule = match (get("nth"), get("probability"), get("seed")) {
            (Some(_), Some(_), _) | (Some(_), _, Some(_)) => {
                return Err("give either 'nth' or 'probability' (with 'seed'), not both".into())
            }
            (Some(FaultSetting::Int(n)), None, None) if *n > 0 => FaultSchedule::Nth(*n),
            (Some(_), None, None) => return Err("'nth' must be a positive int (1 = the first counted call)".into()),
            (None, Some(p), seed) => {
                let p = match p {
                    FaultSetting::Float(p) => *p,
                    FaultSetting::Int(p) => *p as f64,
                    _ => return Err("'probability' must be a number in [0, 1]".into()),
                };
                if !(0.0..=1.0).contains(&p) {
                    return Err(format!("'probability' must be in [0, 1], got {p}"));
                }
                let seed = match seed {
                    None => 0,
                    Some(FaultSetting::Int(s)) => *s,
                    Some(_) => return Err("'seed' must be a non-negative int".into()),
                };
                FaultSchedule::Probability { p, seed }
            }
            (None, None, Some(_)) => return Err("'seed' needs 'probability'".into()),
            (None, None, None) => FaultSchedule::Never,
        };
        let mut plan = FaultPlan::new(schedule);
        match get("effect") {
            None => {}
            Some(FaultSetting::Text(t)) if t == "error" => plan.effect = FaultEffect::Error,
            Some(FaultSetting::Text(t)) if t == "panic" => plan.effect = FaultEffect::Panic,
            Some(FaultSetting::Text(t)) if t == "panic_after" => plan.effect = FaultEffect::PanicAfter,
            Some(other) => return Err(format!("'effect' must be 'error', 'panic' or 'panic_after', not {other:?}")),
        }
        match get("calls") {
            None => {}
            Some(FaultSetting::List(names)) => {
                plan.calls = names
                    .iter()
                    .map(|name| {
                        FaultCall::ALL.into_iter().find(|c| c.name() == name).ok_or_else(|| {
                            let names: Vec<&str> = FaultCall::ALL.iter().map(|c| c.name()).collect();
                            format!("'calls': unknown call '{name}' (known: {})", names.join(", "))
                        })
                    })
                    .collect::<Result<_, _>>()?;
            }
            Some(_) => return Err("'calls' must be a list of call names".into()),
        }
        match get("delay") {
            None => {}
            Some(FaultSetting::Float(s)) if (0.0..=60.0).contains(s) => plan.delay = Duration::from_secs_f64(*s),
            Some(FaultSetting::Int(s)) if *s <= 60 => plan.delay = Duration::from_secs(*s),
            Some(_) => return Err("'delay' must be a number of seconds in [0, 60]".into()),
        }
        Ok(plan)
    }
}

#[derive(Debug)]
pub struct Faulty<D> {
    inner: D,
    plan: FaultPlan,
    calls: u64,
    rng: u64,
}

/// What a counted call must do before (and after) reaching the device.
enum Verdict {
    Proceed,
    Fail,
    PanicAfter,
}

impl<D: Device> Faulty<D> {
    pub fn new(inner: D, plan: FaultPlan) -> Self {
        let rng = match plan.schedule {
            FaultSchedule::Probability { seed, .. } => seed ^ 0x9E37_79B9_7F4A_7C15,
            _ => 0,
        };
        Faulty { inner, plan, calls: 0, rng: rng.max(1) }
    }

    /// xorshift64*: a dependency-free generator; quality is ample for fault schedules.
    fn next_unit(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Sleeps the delay, counts the call if the plan counts its kind, and decides its fate.
    fn judge(&mut self, call: FaultCall) -> Verdict {
        if !self.plan.delay.is_zero() {
            std::thread::sleep(self.plan.delay);
        }
        if !self.plan.calls.contains(&call) {
            return Verdict::Proceed;
        }
        self.calls += 1;
        let hit = match self.plan.schedule {
            FaultSchedule::Never => false,
            FaultSchedule::Nth(n) => self.calls == n,
            FaultSchedule::Probability { p, .. } => self.next_unit() < p,
        };
        match (hit, self.plan.effect) {
            (false, _) => Verdict::Proceed,
            (true, FaultEffect::Error) => Verdict::Fail,
            (true, FaultEffect::Panic) => panic!("injected panic in device call '{}'", call.name()),
            (true, FaultEffect::PanicAfter) => Verdict::PanicAfter,
        }
    }

    /// Runs `op` on the inner device under the plan; `refusal` is the error a failing call returns.
    fn call<T>(
        &mut self,
        call: FaultCall,
        refusal: DeviceError,
        op: impl FnOnce(&mut D) -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        match self.judge(call) {
            Verdict::Proceed => op(&mut self.inner),
            Verdict::Fail => Err(refusal),
            Verdict::PanicAfter => {
                let _ = op(&mut self.inner);
                panic!("injected panic after device call '{}'", call.name())
            }
        }
    }

    fn driver_error(call: FaultCall) -> DeviceError {
        DeviceError::Driver(format!("injected fault in device call '{}'", call.name()))
    }
}

impl<D: Device> Device for Faulty<D> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn allocate(&mut self, size: u64) -> Result<u64, DeviceError> {
        self.call(FaultCall::Allocate, DeviceError::OutOfMemory { requested: size }, |d| d.allocate(size))
    }
    fn allocate_on(&mut self, size: u64, stream: StreamId) -> Result<u64, DeviceError> {
        self.call(FaultCall::Allocate, DeviceError::OutOfMemory { requested: size }, |d| d.allocate_on(size, stream))
    }
    fn release(&mut self, address: u64) -> Result<(), DeviceError> {
        self.call(FaultCall::Release, Self::driver_error(FaultCall::Release), |d| d.release(address))
    }
    fn memory_info(&self) -> MemoryInfo {
        self.inner.memory_info()
    }
    fn host_accessible(&self) -> bool {
        self.inner.host_accessible()
    }
    fn write(&mut self, stream: StreamId, address: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.call(FaultCall::Copy, Self::driver_error(FaultCall::Copy), |d| d.write(stream, address, data))
    }
    fn read(&self, stream: StreamId, address: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // Reads take `&self`: delayed, never failed.
        if !self.plan.delay.is_zero() {
            std::thread::sleep(self.plan.delay);
        }
        self.inner.read(stream, address, out)
    }
    fn captures_graphs(&self) -> bool {
        self.inner.captures_graphs()
    }
    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        self.inner.is_capturing(stream)
    }
    fn capture_id(&mut self, stream: StreamId) -> Result<Option<u64>, DeviceError> {
        self.inner.capture_id(stream)
    }
    fn created_streams(&self) -> Vec<StreamId> {
        self.inner.created_streams()
    }
    fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        self.inner.create_stream()
    }
    fn destroy_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        self.inner.destroy_stream(s)
    }
    fn hold_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        self.inner.hold_stream(s)
    }
    fn query_stream(&mut self, s: StreamId) -> Result<bool, DeviceError> {
        self.inner.query_stream(s)
    }
    fn synchronize_stream(&mut self, s: StreamId) -> Result<(), DeviceError> {
        self.call(FaultCall::Synchronize, Self::driver_error(FaultCall::Synchronize), |d| d.synchronize_stream(s))
    }
    fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        self.call(FaultCall::Synchronize, Self::driver_error(FaultCall::Synchronize), |d| d.synchronize_device())
    }
    fn record_event(&mut self, s: StreamId) -> Result<EventId, DeviceError> {
        self.call(FaultCall::RecordEvent, Self::driver_error(FaultCall::RecordEvent), |d| d.record_event(s))
    }
    fn query_event(&mut self, e: EventId) -> Result<bool, DeviceError> {
        self.inner.query_event(e)
    }
    fn synchronize_event(&mut self, e: EventId) -> Result<(), DeviceError> {
        self.call(FaultCall::Synchronize, Self::driver_error(FaultCall::Synchronize), |d| d.synchronize_event(e))
    }
    fn destroy_event(&mut self, e: EventId) -> Result<(), DeviceError> {
        self.inner.destroy_event(e)
    }
    fn stream_wait_event(&mut self, s: StreamId, e: EventId) -> Result<(), DeviceError> {
        self.inner.stream_wait_event(s, e)
    }
    fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        self.inner.reserve(size)
    }
    fn unreserve(&mut self, address: u64) -> Result<(), DeviceError> {
        self.inner.unreserve(address)
    }
    /// Mapping pages is how paged pools obtain memory, so it fails like `allocate`.
    fn map(&mut self, address: u64, size: u64, handle: u64) -> Result<(), DeviceError> {
        self.call(FaultCall::Map, DeviceError::OutOfMemory { requested: size }, |d| d.map(address, size, handle))
    }
    fn mapping_granularity(&mut self) -> Result<u64, DeviceError> {
        self.inner.mapping_granularity()
    }
    fn ipc_handle(&mut self, address: u64) -> Result<(Vec<u8>, u64), DeviceError> {
        self.inner.ipc_handle(address)
    }
    fn export_pages(&mut self, address: u64, len: u64) -> Result<super::ExportedPages, DeviceError> {
        self.inner.export_pages(address, len)
    }
    fn set_mapping_options(&mut self, options: &super::MappingOptions) {
        self.inner.set_mapping_options(options)
    }
    fn unmap(&mut self, address: u64, size: u64) -> Result<(), DeviceError> {
        self.call(FaultCall::Unmap, Self::driver_error(FaultCall::Unmap), |d| d.unmap(address, size))
    }
    fn import_stream(&mut self, handle: u64) -> Result<StreamId, DeviceError> {
        self.inner.import_stream(handle)
    }
    fn stream_handle(&self, s: StreamId) -> Option<u64> {
        self.inner.stream_handle(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Sim;

    fn settings(pairs: &[(&str, FaultSetting)]) -> Vec<(String, FaultSetting)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    #[test]
    fn nth_refuses_exactly_once() {
        let mut dev = Faulty::new(Sim::new(1 << 30), FaultPlan::new(FaultSchedule::Nth(2)));
        assert!(dev.allocate(1024).is_ok());
        assert!(dev.allocate(1024).is_err());
        assert!(dev.allocate(1024).is_ok());
    }

    #[test]
    fn probability_is_seeded() {
        let outcomes = |seed| {
            let plan = FaultPlan::new(FaultSchedule::Probability { p: 0.5, seed });
            let mut dev = Faulty::new(Sim::new(1 << 40), plan);
            (0..64).map(|_| dev.allocate(512).is_ok()).collect::<Vec<_>>()
        };
        assert_eq!(outcomes(7), outcomes(7));
        let refused = outcomes(7).iter().filter(|ok| !**ok).count();
        assert!((16..48).contains(&refused), "refused {refused} of 64");
    }

    #[test]
    fn chosen_calls_fail_with_driver_errors_and_others_pass() {
        let plan = FaultPlan::from_settings(&settings(&[
            ("nth", FaultSetting::Int(1)),
            ("calls", FaultSetting::List(vec!["record_event".into()])),
        ]))
        .unwrap();
        let mut dev = Faulty::new(Sim::new(1 << 30), plan);
        assert!(dev.allocate(1024).is_ok(), "allocations are not counted");
        assert!(matches!(dev.record_event(0), Err(DeviceError::Driver(_))));
        assert!(dev.record_event(0).is_ok());
    }

    #[test]
    fn panic_after_reaches_the_device_first() {
        let plan = FaultPlan { effect: FaultEffect::PanicAfter, ..FaultPlan::new(FaultSchedule::Nth(1)) };
        let mut dev = Faulty::new(Sim::new(1 << 30), plan);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dev.allocate(4096)));
        assert!(panicked.is_err());
        assert_eq!(dev.memory_info().held, 4096, "the allocation happened before the panic");
    }

    #[test]
    fn settings_errors_name_the_key() {
        let bad = |pairs: &[(&str, FaultSetting)]| FaultPlan::from_settings(&settings(pairs)).unwrap_err();
        assert!(bad(&[("nht", FaultSetting::Int(1))]).contains("'nht'"));
        assert!(bad(&[("nth", FaultSetting::Int(0))]).contains("'nth'"));
        assert!(bad(&[("probability", FaultSetting::Float(1.5))]).contains("'probability'"));
        assert!(bad(&[("calls", FaultSetting::List(vec!["mallco".into()]))]).contains("'mallco'"));
        assert!(bad(&[("effect", FaultSetting::Text("boom".into()))]).contains("'effect'"));
        assert!(bad(&[("delay", FaultSetting::Float(-1.0))]).contains("'delay'"));
        let plan = FaultPlan::from_settings(&settings(&[("delay", FaultSetting::Float(0.25))])).unwrap();
        assert_eq!((plan.schedule, plan.delay), (FaultSchedule::Never, Duration::from_millis(250)));
    }
}
