//! The tanh activation of the MLPs, fast on the CPU.
//!
//! candle's CPU `tanh` calls libm's `tanhf` per element (through `expm1f`): profiling the
//! default CartPole run put about a third of all CPU time there. [`tanh_f32`] is a rational
//! approximation in plain arithmetic that the compiler vectorises; its error against the exact
//! tanh is at most about 3 float ulps (measured 4.0e-7 absolute; the test bounds it at 5e-7), far below what the training
//! or the released model can notice. Hand-written on purpose: candle has no faster tanh, and a
//! custom op is the documented way to add one. Devices other than the CPU, and dtypes other than
//! `f32`, use candle's own `tanh`.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

/// Inputs are clamped to `[-CLAMP, CLAMP]`: beyond it tanh rounds to +-1 in `f32`.
const CLAMP: f32 = 9.0;
// Odd numerator p(x) = x (a1 + a3 x^2 + ... + a13 x^12) and even denominator
// q(x) = b0 + b2 x^2 + b4 x^4 + b6 x^6 of the minimax rational approximation of tanh on
// [-9, 9] (the coefficients Eigen's `generic_fast_tanh_float` publishes).
const A1: f32 = 4.893_524_6e-3;
const A3: f32 = 6.372_619_3e-4;
const A5: f32 = 1.485_722_4e-5;
const A7: f32 = 5.122_297e-8;
const A9: f32 = -8.604_672e-11;
const A11: f32 = 2.000_188e-13;
const A13: f32 = -2.760_768_5e-16;
const B0: f32 = 4.893_525e-3;
const B2: f32 = 2.268_434_6e-3;
const B4: f32 = 1.185_347_1e-4;
const B6: f32 = 1.198_258_4e-6;

/// tanh(x) in `f32`, within 5e-7 of the exact value; NaN stays NaN.
#[inline]
pub fn tanh_f32(x: f32) -> f32 {
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = A13;
    p = p * x2 + A11;
    p = p * x2 + A9;
    p = p * x2 + A7;
    p = p * x2 + A5;
    p = p * x2 + A3;
    p = p * x2 + A1;
    p *= x;
    let mut q = B6;
    q = q * x2 + B4;
    q = q * x2 + B2;
    q = q * x2 + B0;
    // The rational function overshoots 1 by up to 2e-7 just below the clamp; |tanh| <= 1
    // keeps the derivative 1 - tanh^2 non-negative.
    (p / q).clamp(-1.0, 1.0)
}

/// tanh of every element in place.
pub fn tanh_in_place(v: &mut [f32]) {
    for x in v {
        *x = tanh_f32(*x);
    }
}

struct FastTanh;

impl CustomOp1 for FastTanh {
    fn name(&self) -> &'static str {
        "fast-tanh"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(src) = storage else {
            candle_core::bail!("fast-tanh: f32 tensors only");
        };
        let out = match layout.contiguous_offsets() {
            Some((start, end)) => src[start..end].iter().map(|&x| tanh_f32(x)).collect(),
            None => candle_core::cpu_backend::unary_map(src, layout, tanh_f32),
        };
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // d tanh(x) / dx = 1 - tanh(x)^2.
        Ok(Some((grad_res * res.sqr()?.affine(-1.0, 1.0)?)?))
    }
}

/// tanh of a tensor: [`tanh_f32`] for `f32` tensors on the CPU (differentiable), candle's own
/// `tanh` elsewhere.
pub fn tanh(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.device().is_cpu() && t.dtype() == DType::F32 {
        t.apply_op1(FastTanh)
    } else {
        t.tanh()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn close_to_the_exact_tanh_everywhere() {
        let mut worst = 0.0f64;
        let mut x = -12.0f64;
        while x <= 12.0 {
            let got = tanh_f32(x as f32) as f64;
            worst = worst.max((got - (x as f32 as f64).tanh()).abs());
            x += 1e-4;
        }
        assert!(worst < 5e-7, "largest error {worst}");
        assert_eq!(tanh_f32(0.0), 0.0);
        assert_eq!(tanh_f32(50.0), 1.0);
        assert_eq!(tanh_f32(-50.0), -1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
        let mut x = 0.0f32;
        while x < 12.0 {
            assert!(
                tanh_f32(x) <= 1.0 && tanh_f32(x) >= 0.0,
                "tanh({x}) = {}",
                tanh_f32(x)
            );
            x += 1e-3;
        }
        // Odd function, bit for bit.
        for &v in &[0.1f32, 0.5, 1.7, 4.2] {
            assert_eq!(tanh_f32(-v), -tanh_f32(v));
        }
    }

    #[test]
    fn tensor_op_and_gradient_match_candle() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let vals: Vec<f32> = (0..48).map(|i| (i as f32 - 24.0) * 0.21).collect();
        let x = Var::from_vec(vals, (2, 4, 6), &dev)?;
        // A strided view exercises the non-contiguous path.
        let xt = x.as_tensor().transpose(1, 2)?;
        let w = Tensor::arange(0f32, 48.0, &dev)?.reshape((2, 6, 4))?;
        let fast = (tanh(&xt)? * &w)?.sum_all()?;
        let exact = (xt.tanh()? * &w)?.sum_all()?;
        let (f, e) = (fast.to_scalar::<f32>()?, exact.to_scalar::<f32>()?);
        assert!((f - e).abs() < 1e-4 * e.abs().max(1.0), "{f} vs {e}");
        let gf = fast.backward()?.get(&x).expect("grad").flatten_all()?;
        let ge = exact.backward()?.get(&x).expect("grad").flatten_all()?;
        let diff = (gf - ge)?.abs()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "gradient differs by {diff}");
        Ok(())
    }
}
