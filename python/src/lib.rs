//! `plyfs._native`: hosts one layer or codec written in Python for a plyfs mount.
//!
//! The mount starts the script (`py:script=FILE`) with a socket as descriptor 3, or reaches it
//! on a Unix socket (`ext:socket=PATH`). Every request the mount sends becomes a `Request` handed
//! to the Python handler; `Request.forward()` sends it on to the level below, in the mount. The
//! protocol, framing and threads are the Rust ones of `plyfs-transport`; Python only sees the
//! operations it chose to answer.

use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use plyfs_stack::Error;
use plyfs_transport::client::Incoming;
use plyfs_transport::host::{self, Below};
use plyfs_transport::wire::{CodecOp, Hosted, OpHeader, RequestOp, WireCaller, WireError, WireExtOp, WireReply};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// MessagePack values (what the protocol's headers are made of) to Python and back.
fn to_py<'py>(py: Python<'py>, v: &rmpv::Value) -> PyResult<Bound<'py, PyAny>> {
    use rmpv::Value as V;
    Ok(match v {
        V::Nil => py.None().into_bound(py),
        V::Boolean(b) => PyBool::new(py, *b).to_owned().into_any(),
        V::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(s)) => s.into_pyobject(py)?.into_any(),
            _ => py.None().into_bound(py),
        },
        V::F32(f) => PyFloat::new(py, f64::from(*f)).into_any(),
        V::F64(f) => PyFloat::new(py, *f).into_any(),
        V::String(s) => PyString::new(py, s.as_str().unwrap_or("")).into_any(),
        V::Binary(b) => PyBytes::new(py, b).into_any(),
        V::Array(a) => {
            let items = a.iter().map(|x| to_py(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        V::Map(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(to_py(py, k)?, to_py(py, x)?)?;
            }
            d.into_any()
        }
        V::Ext(_, b) => PyBytes::new(py, b).into_any(),
    })
}

fn from_py(o: &Bound<'_, PyAny>) -> PyResult<rmpv::Value> {
    use rmpv::Value as V;
    if o.is_none() {
        return Ok(V::Nil);
    }
    if let Ok(b) = o.cast::<PyBool>() {
        return Ok(V::Boolean(b.is_true()));
    }
    if o.cast::<PyInt>().is_ok() {
        if let Ok(u) = o.extract::<u64>() {
            return Ok(V::from(u));
        }
        return Ok(V::from(o.extract::<i64>()?));
    }
    if let Ok(f) = o.cast::<PyFloat>() {
        return Ok(V::F64(f.value()));
    }
    if let Ok(s) = o.cast::<PyString>() {
        return Ok(V::from(s.to_cow()?.as_ref()));
    }
    if let Ok(b) = o.cast::<PyBytes>() {
        return Ok(V::Binary(b.as_bytes().to_vec()));
    }
    if let Ok(d) = o.cast::<PyDict>() {
        let mut m = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            m.push((from_py(&k)?, from_py(&v)?));
        }
        return Ok(V::Map(m));
    }
    if let Ok(l) = o.cast::<PyList>() {
        return Ok(V::Array(l.iter().map(|x| from_py(&x)).collect::<PyResult<_>>()?));
    }
    if let Ok(t) = o.cast::<PyTuple>() {
        return Ok(V::Array(t.iter().map(|x| from_py(&x)).collect::<PyResult<_>>()?));
    }
    Err(PyValueError::new_err(format!("cannot send a {} to plyfs", o.get_type().name()?)))
}

/// An operation and its arguments as a Python dict (names as bytes).
fn op_args<'py>(py: Python<'py>, op: &RequestOp) -> PyResult<(String, Bound<'py, PyAny>)> {
    let bytes = rmp_serde::to_vec_named(op).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let v: rmpv::Value = rmp_serde::from_slice(&bytes).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let get = |k: &str| v.as_map().and_then(|m| m.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, x)| x.clone()));
    let name = get("op").and_then(|n| n.as_str().map(str::to_owned)).unwrap_or_default();
    let args = get("args").unwrap_or(rmpv::Value::Map(Vec::new()));
    Ok((name, to_py(py, &args)?))
}

fn wire_op(name: &str, args: &Bound<'_, PyAny>) -> PyResult<OpHeader> {
    let v = rmpv::Value::Map(vec![(rmpv::Value::from("op"), rmpv::Value::from(name)), (rmpv::Value::from("args"), from_py(args)?)]);
    let bytes = rmp_serde::to_vec_named(&v).map_err(|e| PyValueError::new_err(e.to_string()))?;
    rmp_serde::from_slice(&bytes).map_err(|e| PyValueError::new_err(format!("operation '{name}': {e}")))
}

/// The answer of the level below (or of this layer): what kind, and its content.
#[pyclass(module = "plyfs._native")]
struct Reply {
    wire: WireReply,
    payload: Vec<u8>,
}

#[pymethods]
impl Reply {
    /// `"entry"`, `"attr"`, `"data"`, `"written"`, `"opened"`, `"dir"`, `"extended"`, `"error"`, ...
    #[getter]
    fn kind(&self) -> String {
        let bytes = rmp_serde::to_vec_named(&self.wire).unwrap_or_default();
        let v: rmpv::Value = rmp_serde::from_slice(&bytes).unwrap_or(rmpv::Value::Nil);
        v.as_map()
            .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some("r")).and_then(|(_, x)| x.as_str().map(str::to_owned)))
            .unwrap_or_default()
    }

    /// The reply's value: a dict for entries and attributes, a number for `written`, the answer
    /// of an extended operation, None for data (see `data`).
    #[getter]
    fn value<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let bytes = rmp_serde::to_vec_named(&self.wire).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let v: rmpv::Value = rmp_serde::from_slice(&bytes).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let inner = v.as_map().and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some("v")).map(|(_, x)| x.clone()));
        to_py(py, &inner.unwrap_or(rmpv::Value::Nil))
    }

    /// File data (`read`), a symlink target, an attribute value.
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.payload)
    }

    /// The error number, 0 if the operation succeeded.
    #[getter]
    fn errno(&self) -> i32 {
        match &self.wire {
            WireReply::Error(e) => e.errno,
            _ => 0,
        }
    }

    fn __repr__(&self) -> String {
        match &self.wire {
            WireReply::Error(e) => format!("<Reply error {}: {}>", e.errno, e.msg),
            _ => format!("<Reply {} ({} bytes of data)>", self.kind(), self.payload.len()),
        }
    }
}

/// One request from the mount.
#[pyclass(module = "plyfs._native")]
struct Request {
    op: RequestOp,
    caller: WireCaller,
    payload: Vec<u8>,
    below: Arc<Below>,
}

fn raise_if_error(r: Reply) -> PyResult<Reply> {
    match &r.wire {
        WireReply::Error(e) => Err(PyOSError::new_err((e.errno, e.msg.clone()))),
        _ => Ok(r),
    }
}

#[pymethods]
impl Request {
    /// The operation's name (`lookup`, `open`, `read`, an extended operation's name, `encode`).
    #[getter]
    fn op(&self) -> String {
        self.op.name().to_owned()
    }

    /// The operation's arguments by name (file names are bytes).
    #[getter]
    fn args<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(op_args(py, &self.op)?.1)
    }

    /// Who asked: (uid, gid, pid).
    #[getter]
    fn caller(&self) -> (u32, u32, u32) {
        (self.caller.uid, self.caller.gid, self.caller.pid)
    }

    /// The bytes that come with the request: data to write, a chunk to encode or decode.
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.payload)
    }

    /// Send the request on to the level below (with `data` instead of its own, if given) and
    /// return its reply.
    #[pyo3(signature = (data = None))]
    fn forward(&self, py: Python<'_>, data: Option<Vec<u8>>) -> Reply {
        let payload = data.unwrap_or_else(|| self.payload.clone());
        let (op, caller, below) = (self.op.clone(), self.caller, self.below.clone());
        let (wire, payload) = py.detach(move || below.call_wire(caller, op, &payload));
        Reply { wire, payload }
    }

    /// Run any operation on the level below, as this request's caller: `call("getattr",
    /// {"node": 1, "fh": None})`. Raises OSError if it fails.
    #[pyo3(signature = (op, args, data = None))]
    fn call(&self, py: Python<'_>, op: &str, args: &Bound<'_, PyAny>, data: Option<Vec<u8>>) -> PyResult<Reply> {
        let op = wire_op(op, args)?;
        let (caller, below) = (self.caller, self.below.clone());
        let payload = data.unwrap_or_default();
        let (wire, payload) = py.detach(move || below.call_wire(caller, op.into(), &payload));
        raise_if_error(Reply { wire, payload })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let args = self.args(py).map(|a| a.to_string()).unwrap_or_default();
        format!("<Request {} {args}>", self.op())
    }
}

/// What a handler's return value means: a Reply as it is, None to forward, bytes for data, an
/// int for `written`, anything else as the answer of an extended operation.
fn answer(py: Python<'_>, req: &Request, result: PyResult<Bound<'_, PyAny>>) -> (WireReply, Vec<u8>) {
    let fail = |e: Error| (WireReply::Error(WireError::from(&e)), Vec::new());
    let value = match result {
        Ok(v) => v,
        Err(e) => {
            if e.is_instance_of::<PyOSError>(py) {
                let errno = e.value(py).getattr("errno").ok().and_then(|n| n.extract::<i32>().ok()).unwrap_or(libc::EIO);
                let msg = e.value(py).to_string();
                return (WireReply::Error(WireError { errno, msg, class: None }), Vec::new());
            }
            e.print(py);
            return fail(Error::Corrupt(format!("the Python layer failed on {}: {e}", req.op.name())));
        }
    };
    if value.is_none() {
        let r = req.forward(py, None);
        return (r.wire, r.payload);
    }
    if let Ok(r) = value.cast::<Reply>() {
        let r = r.borrow();
        return (r.wire.clone(), r.payload.clone());
    }
    let is_ext = matches!(req.op, RequestOp::Stack(OpHeader::Extended { .. }));
    if !is_ext {
        if let Ok(b) = value.cast::<PyBytes>() {
            let reply = match req.op {
                RequestOp::Stack(OpHeader::GetXattr { .. } | OpHeader::ListXattr { .. }) => WireReply::Xattr,
                _ => WireReply::Data,
            };
            return (reply, b.as_bytes().to_vec());
        }
        if let (RequestOp::Stack(OpHeader::Write { .. }), Ok(n)) = (&req.op, value.extract::<u32>()) {
            return (WireReply::Written(n), Vec::new());
        }
        return fail(Error::Corrupt(format!("the Python layer answered {} with a {}", req.op.name(), value.get_type())));
    }
    let json = from_py(&value).ok().and_then(|v| rmpv::ext::from_value::<serde_json::Value>(v).ok());
    match json {
        Some(j) => (WireReply::Extended(j), Vec::new()),
        None => fail(Error::Corrupt("the Python layer's answer cannot be sent as JSON".into())),
    }
}

/// `encode` or `decode` of one chunk by the codec object.
fn run_codec(py: Python<'_>, codec: &Bound<'_, PyAny>, op: &RequestOp, payload: &[u8]) -> (WireReply, Vec<u8>) {
    let err = |errno: i32, msg: String| (WireReply::Error(WireError { errno, msg, class: None }), Vec::new());
    let (method, expect) = match op {
        RequestOp::Codec(CodecOp::Encode { .. }) => ("encode", None),
        RequestOp::Codec(CodecOp::Decode { decoded_len, .. }) => ("decode", Some(*decoded_len as usize)),
        other => return err(libc::ENOSYS, format!("a codec does not answer {}", other.name())),
    };
    let result = codec.call_method1(method, (PyBytes::new(py, payload),));
    let out = match result {
        Ok(v) => match v.cast::<PyBytes>() {
            Ok(b) => b.as_bytes().to_vec(),
            Err(_) => match v.extract::<Vec<u8>>() {
                Ok(b) => b,
                Err(_) => return err(libc::EIO, format!("the codec's {method} returned a {}, not bytes", v.get_type())),
            },
        },
        Err(e) => {
            e.print(py);
            return err(libc::EIO, format!("the codec's {method} failed: {e}"));
        }
    };
    if let Some(n) = expect.filter(|n| *n != out.len()) {
        return err(libc::EIO, format!("decode gave {} bytes, not {n}", out.len()));
    }
    (WireReply::Data, out)
}

fn hosted_info(info: &Bound<'_, PyDict>) -> PyResult<(String, Hosted, Vec<WireExtOp>)> {
    let get = |k: &str| info.get_item(k).ok().flatten();
    let name: String = get("name").map(|v| v.extract()).transpose()?.unwrap_or_else(|| "py".into());
    let kind: String = get("kind").map(|v| v.extract()).transpose()?.unwrap_or_else(|| "layer".into());
    let ops: Vec<String> = get("ops").map(|v| v.extract()).transpose()?.unwrap_or_default();
    let data: Option<String> = get("data").map(|v| v.extract()).transpose()?;
    let tag: Option<Vec<u8>> = get("tag").map(|v| v.extract()).transpose()?;
    let deterministic: Option<bool> = get("deterministic").map(|v| v.extract()).transpose()?;
    let compresses: Option<bool> = get("compresses").map(|v| v.extract()).transpose()?;
    let ext: Vec<(String, String)> = get("ext_ops").map(|v| v.extract()).transpose()?.unwrap_or_default();
    let ext_ops = ext.into_iter().map(|(n, help)| WireExtOp { name: n, args: String::new(), help, level: name.clone() }).collect();
    let hosted = Hosted { kind, ops, data, tag: tag.map(Into::into), deterministic, compresses };
    Ok((name, hosted, ext_ops))
}

fn serve_stream(stream: UnixStream, info: &(String, Hosted, Vec<WireExtOp>), handler: Arc<Py<PyAny>>) -> Result<(), String> {
    let (name, hosted, ext_ops) = info.clone();
    let kind = hosted.kind.clone();
    let welcome = host::welcome(&name, &kind, hosted, ext_ops);
    let below = Below::new();
    let below_for_requests = below.clone();
    let codec = kind == "codec";
    let incoming: Incoming = Arc::new(move |caller, op, payload| {
        Python::attach(|py| {
            // A codec's chunks go straight to its encode or decode: no request object.
            if codec {
                return run_codec(py, handler.bind(py), &op, &payload);
            }
            let fail = |e: PyErr| (WireReply::Error(WireError { errno: libc::EIO, msg: e.to_string(), class: None }), Vec::new());
            let obj = match Py::new(py, Request { op, caller, payload, below: below_for_requests.clone() }) {
                Ok(o) => o,
                Err(e) => return fail(e),
            };
            let result = handler.bind(py).call1((obj.clone_ref(py),));
            let req = obj.borrow(py);
            answer(py, &req, result)
        })
    });
    Ok(host::serve(Box::new(stream), welcome, &below, incoming)?)
}

/// Serve the mount at the other end of descriptor `fd` until it goes.
#[pyfunction]
fn serve_fd(py: Python<'_>, fd: i32, info: &Bound<'_, PyDict>, handler: Py<PyAny>) -> PyResult<()> {
    let info = hosted_info(info)?;
    // SAFETY: the mount gave this process the descriptor to own.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let handler = Arc::new(handler);
    py.detach(move || serve_stream(stream, &info, handler)).map_err(PyOSError::new_err)
}

/// Listen on the Unix socket `path` and serve each mount that connects (`ext:socket=PATH`).
#[pyfunction]
fn serve_socket(py: Python<'_>, path: &str, info: &Bound<'_, PyDict>, handler: Py<PyAny>) -> PyResult<()> {
    let info = Arc::new(hosted_info(info)?);
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).map_err(|e| PyOSError::new_err(format!("{path}: {e}")))?;
    let handler = Arc::new(handler);
    py.detach(move || {
        for stream in listener.incoming() {
            let stream = stream.map_err(|e| e.to_string())?;
            let (info, handler) = (info.clone(), handler.clone());
            std::thread::spawn(move || {
                if let Err(e) = serve_stream(stream, &info, handler) {
                    eprintln!("plyfs: a mount: {e}");
                }
            });
        }
        Ok::<(), String>(())
    })
    .map_err(PyOSError::new_err)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Request>()?;
    m.add_class::<Reply>()?;
    m.add_function(wrap_pyfunction!(serve_fd, m)?)?;
    m.add_function(wrap_pyfunction!(serve_socket, m)?)?;
    Ok(())
}
