//! Fills through the CUDA driver API, loaded at run time (`libcuda.so.1`), so the crate builds and
//! tests without CUDA.
//!
//! The copies go on the caller's copy stream (a `CUstream`, e.g. torch's `Stream.cuda_stream`)
//! as `cuMemcpyHtoDAsync` from the pinned pool arena: copy engines, not SMs. The driver thread
//! binds the device's primary context (the one the CUDA runtime, and so torch, uses), queues a
//! write of the layer's fill flag after its copies (`cuStreamWriteValue32`), and waits on one
//! event recorded after them.
use std::ffi::c_void;

use libloading::Library;

use super::{check_fill, SlotCopier};
use crate::error::DriverError;

type CuResult = i32;
type CuDevice = i32;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;

/// CUDA_ERROR_NOT_READY: an event query before the work is done.
const CUDA_ERROR_NOT_READY: CuResult = 600;
/// How long one layer's fills may take before the step fails (a wedged copy stream).
const FILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// CU_EVENT_DISABLE_TIMING: the cheapest event.
const CU_EVENT_DISABLE_TIMING: u32 = 2;
/// CU_STREAM_WRITE_VALUE_DEFAULT: the write waits for earlier writes to be visible (a fence).
const CU_STREAM_WRITE_VALUE_DEFAULT: u32 = 0;
/// CU_EVENT_DEFAULT: an event that records a timestamp.
const CU_EVENT_DEFAULT: u32 = 0;
/// One group of fills in this many is timed (two more event records on the driver's CUDA path).
const TIME_FILLS_EVERY: u32 = 4;

struct Api {
    _lib: Library,
    device_get: unsafe extern "C" fn(*mut CuDevice, i32) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    memcpy_htod_async: unsafe extern "C" fn(u64, *const c_void, usize, CuStream) -> CuResult,
    event_create: unsafe extern "C" fn(*mut CuEvent, u32) -> CuResult,
    event_record: unsafe extern "C" fn(CuEvent, CuStream) -> CuResult,
    event_query: unsafe extern "C" fn(CuEvent) -> CuResult,
    event_destroy: unsafe extern "C" fn(CuEvent) -> CuResult,
    event_elapsed: unsafe extern "C" fn(*mut f32, CuEvent, CuEvent) -> CuResult,
    /// `cuStreamWriteValue32_v2` (stream memory operations, CUDA 11.7+), where the driver has it.
    write_value32: Option<unsafe extern "C" fn(CuStream, u64, u32, u32) -> CuResult>,
}

fn check(what: &str, r: CuResult) -> Result<(), DriverError> {
    if r == 0 {
        Ok(())
    } else {
        Err(DriverError::Cuda(format!(
            "{what} failed with CUDA error {r}"
        )))
    }
}

impl Api {
    fn load() -> Result<Self, DriverError> {
        // SAFETY: loading the system's CUDA driver library, whose initialisers are sound.
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| {
            DriverError::Cuda(format!("cannot load the CUDA driver (libcuda.so.1): {e}"))
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has this C signature in the CUDA driver API (cuda.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| DriverError::Cuda(format!("libcuda.so.1 lacks {}: {e}", $name)))?
            };
        }
        Ok(Self {
            device_get: sym!("cuDeviceGet"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: sym!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
            event_create: sym!("cuEventCreate"),
            event_record: sym!("cuEventRecord"),
            event_query: sym!("cuEventQuery"),
            event_destroy: sym!("cuEventDestroy_v2"),
            event_elapsed: sym!("cuEventElapsedTime"),
            // SAFETY: as `sym!`; optional.
            write_value32: unsafe { lib.get(b"cuStreamWriteValue32_v2\0") }
                .ok()
                .map(|f| *f),
            _lib: lib,
        })
    }
}

/// Copies pool experts into device slots on a CUDA stream.
pub struct CudaCopier {
    api: Api,
    device: CuDevice,
    ctx: CuContext,
    stream: CuStream,
    event: CuEvent,
    /// Timing events around one group of fills in `TIME_FILLS_EVERY`.
    timed: [CuEvent; 2],
    groups: u32,
    slots: u64,
    stride: usize,
    num_slots: usize,
    pending: bool,
    /// The pending group's end event is recorded (`end_group`).
    ended: bool,
}

// SAFETY: the CUDA handles are process-wide driver objects, usable from any thread that binds
// the context (`attach`); the copier is used by one thread at a time.
unsafe impl Send for CudaCopier {}

impl CudaCopier {
    /// A copier into `num_slots` slots of `stride` bytes at device address `slots` of device
    /// `ordinal`, on stream `stream` (a `CUstream` handle; 0 is the legacy default stream).
    ///
    /// # Errors
    /// `Cuda` if the driver library cannot be loaded or the device's context not retained.
    ///
    /// # Safety
    /// `slots` must be a device allocation of `num_slots * stride` bytes on that device, and
    /// `stream` a live stream of its primary context, both outliving the copier.
    pub unsafe fn new(
        ordinal: i32,
        stream: usize,
        slots: u64,
        stride: usize,
        num_slots: usize,
    ) -> Result<Self, DriverError> {
        let api = Api::load()?;
        let mut device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointers to locals.
        unsafe {
            check("cuDeviceGet", (api.device_get)(&mut device, ordinal))?;
            check(
                "cuDevicePrimaryCtxRetain",
                (api.primary_ctx_retain)(&mut ctx, device),
            )?;
        }
        Ok(Self {
            api,
            device,
            ctx,
            stream: stream as CuStream,
            event: std::ptr::null_mut(),
            timed: [std::ptr::null_mut(); 2],
            groups: 0,
            slots,
            stride,
            num_slots,
            pending: false,
            ended: false,
        })
    }
}

impl CudaCopier {
    /// Whether the current group of fills is timed.
    fn timing(&self) -> bool {
        self.groups % TIME_FILLS_EVERY == 1
    }

    /// The event that marks the end of the current group: the second timing event when it is
    /// timed, the untimed one otherwise.
    fn done_event(&self) -> CuEvent {
        if self.timing() {
            self.timed[1]
        } else {
            self.event
        }
    }
}

impl SlotCopier for CudaCopier {
    fn attach(&mut self) -> Result<(), DriverError> {
        // Called on each thread that queues copies (the decode driver's, and the one running
        // eager steps); the events are made once.
        // SAFETY: a retained primary context; out-pointers to fields.
        unsafe {
            check("cuCtxSetCurrent", (self.api.ctx_set_current)(self.ctx))?;
            for e in &mut self.timed {
                if e.is_null() {
                    check(
                        "cuEventCreate",
                        (self.api.event_create)(e, CU_EVENT_DEFAULT),
                    )?;
                }
            }
            if self.event.is_null() {
                check(
                    "cuEventCreate",
                    (self.api.event_create)(&mut self.event, CU_EVENT_DISABLE_TIMING),
                )?;
            }
            Ok(())
        }
    }

    unsafe fn copy(
        &mut self,
        slot: usize,
        src: *const u8,
        nbytes: usize,
    ) -> Result<(), DriverError> {
        check_fill(slot, nbytes, self.num_slots, self.stride)?;
        let dst = self.slots + (slot * self.stride) as u64;
        if !self.pending {
            self.groups = self.groups.wrapping_add(1);
            if self.timing() {
                // SAFETY: event created in `attach`, stream live (constructor contract).
                let r = unsafe { (self.api.event_record)(self.timed[0], self.stream) };
                check("cuEventRecord", r)?;
            }
        }
        // SAFETY: destination in bounds (checked); `src` per the trait's contract.
        let r =
            unsafe { (self.api.memcpy_htod_async)(dst, src as *const c_void, nbytes, self.stream) };
        check("cuMemcpyHtoDAsync", r)?;
        self.pending = true;
        self.ended = false; // a copy after `end_group`: `wait` marks the end again, after it
        Ok(())
    }

    fn end_group(&mut self) -> Result<(), DriverError> {
        if self.pending && !self.ended {
            // SAFETY: events created in `attach`, stream live (constructor contract).
            let r = unsafe { (self.api.event_record)(self.done_event(), self.stream) };
            check("cuEventRecord", r)?;
            self.ended = true;
        }
        Ok(())
    }

    fn wait(&mut self) -> Result<Option<f64>, DriverError> {
        if !self.pending {
            return Ok(None);
        }
        self.end_group()?;
        self.pending = false;
        self.ended = false;
        let timed = self.timing();
        let done = self.done_event();
        // SAFETY: events created in `attach`, stream live (constructor contract).
        unsafe {
            let start = std::time::Instant::now();
            loop {
                match (self.api.event_query)(done) {
                    0 if timed => {
                        let mut ms = 0f32;
                        let r = (self.api.event_elapsed)(&mut ms, self.timed[0], done);
                        check("cuEventElapsedTime", r)?;
                        return Ok(Some(f64::from(ms) / 1e3));
                    }
                    0 => return Ok(None),
                    CUDA_ERROR_NOT_READY => {
                        if start.elapsed() > FILL_TIMEOUT {
                            return Err(DriverError::Timeout(format!(
                                "fills on the copy stream did not complete within {FILL_TIMEOUT:?}"
                            )));
                        }
                        // Each query is a driver call (microseconds); spin between them.
                        for _ in 0..64 {
                            std::hint::spin_loop();
                        }
                    }
                    r => return check("cuEventQuery", r).map(|()| None),
                }
            }
        }
    }

    unsafe fn publish(&mut self, flag: *mut u32, value: u32) -> Result<bool, DriverError> {
        // SAFETY: per the trait's contract.
        Ok(unsafe { self.write_flag(flag, value) })
    }
}

impl CudaCopier {
    /// `SlotCopier::publish` through a stream memory operation on the copy stream. The flag's
    /// host address is its device address (registered host memory under unified addressing,
    /// which is how the device's kernels read the handshake too). A driver that refuses it
    /// turns publishing off: the host raises the flags after the fills' wait instead.
    unsafe fn write_flag(&mut self, flag: *mut u32, value: u32) -> bool {
        let Some(write) = self.api.write_value32 else {
            return false;
        };
        // SAFETY: stream live (constructor contract); `flag` per `SlotCopier::publish`.
        let r = unsafe {
            write(
                self.stream,
                flag as u64,
                value,
                CU_STREAM_WRITE_VALUE_DEFAULT,
            )
        };
        if r != 0 {
            self.api.write_value32 = None;
            return false;
        }
        true
    }
}

impl Drop for CudaCopier {
    fn drop(&mut self) {
        // SAFETY: handles created by this copier.
        unsafe {
            for e in [self.event, self.timed[0], self.timed[1]] {
                if !e.is_null() {
                    (self.api.event_destroy)(e);
                }
            }
            (self.api.primary_ctx_release)(self.device);
        }
    }
}
