/* Shared by the BLAS forward's files (sgemv_forward.c, prefill_attention.c, swiglu.c). */
#ifndef VELOXQUANT_FORWARD_H
#define VELOXQUANT_FORWARD_H

enum { VQ_ROW_MAJOR = 101, VQ_NO_TRANS = 111, VQ_TRANS = 112 }; /* CBLAS enum values */

/* 0 when the forward only passes calls on (VELOXQUANT_NO_SGEMV_FORWARD, sgemv_forward.c):
 * its own paths, the one-row sgemv and the prompt kernels, then report themselves
 * unsupported. */
int vq_forward_routes(void);

#endif
