/* A region of a JPEG, decoded at a reduced scale: what jaxtrain.data.jpeg calls through ctypes.
 *
 * libjpeg-turbo (libjpeg's API, 2.1 or newer) decodes at M/8 of the full size (M = 1..8, its scaled inverse
 * DCTs), skips the rows above the region (jpeg_skip_scanlines: no inverse DCT, no colour conversion), leaves the
 * columns beside it untransformed (jpeg_crop_scanline) and never reads the rows below it. Errors never exit:
 * libjpeg's error handler jumps back here and the message is copied out; a file that ends early is an error
 * (libjpeg would fill the rest with grey and warn), other warnings (extraneous bytes) are not.
 */
#include <csetjmp>
#include <cstdio>
#include <cstring>

extern "C" {
#include <jpeglib.h>
#include <jerror.h>
}

#define MESSAGE_BYTES 200

struct failure {
  struct jpeg_error_mgr pub;
  jmp_buf back;
  char *message;
};

static void on_error(j_common_ptr info) {
  failure *f = reinterpret_cast<failure *>(info->err);
  char text[JMSG_LENGTH_MAX];
  (*info->err->format_message)(info, text);
  snprintf(f->message, MESSAGE_BYTES, "%s", text);
  longjmp(f->back, 1);
}

static void on_message(j_common_ptr info, int level) {
  if (level < 0 && info->err->msg_code == JWRN_JPEG_EOF) on_error(info); /* a truncated file */
}

#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2001000
#error "libjpeg-turbo 2.1 or newer is needed (jpeg_skip_scanlines could loop forever on progressive JPEGs before)"
#endif

/* The error manager, before anything can fail: jpeg_create_decompress may fail too (setjmp comes first). */
static void begin(struct jpeg_decompress_struct *info, struct failure *f, char *message) {
  memset(info, 0, sizeof *info);
  info->err = jpeg_std_error(&f->pub);
  f->pub.error_exit = on_error;
  f->pub.emit_message = on_message;
  f->message = message;
  message[0] = 0;
}

extern "C" {

/* The image's size, libjpeg's colour space (JCS_*) and its largest sampling factor from its header; 0, or -1
 * with ``message``. */
int jt_jpeg_header(const unsigned char *data, unsigned long size, int *width, int *height, int *space,
                   int *sampling, char *message) {
  struct jpeg_decompress_struct info;
  struct failure f;
  begin(&info, &f, message);
  if (setjmp(f.back)) {
    jpeg_destroy_decompress(&info);
    return -1;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, data, size);
  jpeg_read_header(&info, TRUE);
  *width = (int)info.image_width;
  *height = (int)info.image_height;
  *space = (int)info.jpeg_color_space;
  *sampling = info.max_h_samp_factor > info.max_v_samp_factor ? info.max_h_samp_factor : info.max_v_samp_factor;
  jpeg_destroy_decompress(&info);
  return 0;
}

/* Rows [top, bottom) of the image decoded at ``scale``/8, as RGB, columns [*left, *left + *width) of it: the
 * caller's [*left, *right) widened to libjpeg's block boundaries (``*left`` and ``*width`` are set to what was
 * decoded). ``out`` holds (bottom - top) rows of the scaled image's full width (3 bytes a pixel, rows of
 * *width pixels). 0, or -1 with ``message``; -2 (nothing allocated) if the header declares more than
 * ``max_pixels`` pixels (0: no limit), as Pillow refuses a decompression bomb. */
int jt_jpeg_region(const unsigned char *data, unsigned long size, int scale, int *left, int right, int top,
                   int bottom, unsigned char *out, int *width, unsigned long long max_pixels, char *message) {
  struct jpeg_decompress_struct info;
  struct failure f;
  begin(&info, &f, message);
  if (setjmp(f.back)) {
    jpeg_destroy_decompress(&info);
    return -1;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, data, size);
  jpeg_read_header(&info, TRUE);
  unsigned long long pixels = (unsigned long long)info.image_width * info.image_height;
  if (max_pixels && pixels > max_pixels) {
    snprintf(message, MESSAGE_BYTES, "Image size (%llu pixels) exceeds limit of %llu pixels, could be decompression "
             "bomb DOS attack.", pixels, max_pixels);
    jpeg_destroy_decompress(&info);
    return -2;
  }
  info.out_color_space = JCS_RGB;
  info.scale_num = (unsigned int)scale;
  info.scale_denom = 8;
  jpeg_start_decompress(&info);
  if (top < 0 || bottom > (int)info.output_height || top >= bottom || *left < 0 || right > (int)info.output_width ||
      *left >= right) {
    snprintf(message, MESSAGE_BYTES, "region %d:%d x %d:%d outside the %ux%u image", *left, right, top, bottom,
             info.output_width, info.output_height);
    jpeg_destroy_decompress(&info);
    return -1;
  }
  JDIMENSION x = (JDIMENSION)*left, w = (JDIMENSION)(right - *left);
  if (w < info.output_width) jpeg_crop_scanline(&info, &x, &w);
  *left = (int)x;
  *width = (int)w;
  if (top > 0) jpeg_skip_scanlines(&info, (JDIMENSION)top);
  for (int row = 0; row < bottom - top;) {
    JSAMPROW line = out + (size_t)row * w * 3;
    JDIMENSION got = jpeg_read_scanlines(&info, &line, 1);
    if (got == 0) {
      snprintf(message, MESSAGE_BYTES, "no scanline at row %d", top + row);
      jpeg_destroy_decompress(&info);
      return -1;
    }
    row += (int)got;
  }
  jpeg_abort_decompress(&info); /* the rows below are never read */
  jpeg_destroy_decompress(&info);
  return 0;
}

}  // extern "C"
