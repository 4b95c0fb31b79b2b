// The precision choices of a run, as the config's keys name them (coat/config.h parses them; its
// rows list each choice's text in enum order): the GEMMs (precision), the storage of the
// activations saved for backward (coat/activations.h), of the optimizer states
// (coat/optimizer_states.h) and of the parameters that ZeRO gathers. Plain C.
#pragma once

typedef enum { PRECISION_BF16, PRECISION_FP8, PRECISION_COAT } Precision;
typedef enum { STATES_AUTO, STATES_FP32, STATES_BF16, STATES_FP8, STATES_FP8_DRE } StatesChoice;
// coat_residual and coat_gate_up: COAT's 1x16 copies of one kind of non-linear input only (ablations).
typedef enum { ACTS_AUTO, ACTS_BF16, ACTS_FP8, ACTS_COAT, ACTS_COAT_RESIDUAL, ACTS_COAT_GATE_UP } ActivationsChoice;
typedef enum { GATHER_AUTO, GATHER_BF16, GATHER_E4M3 } ParamGatherChoice;
